"""The engine requests of one HTTP request (``EngineRun``): submitted together, their deltas read
from one queue (``DeltaSink``), aborted together when the handler leaves, and merged per prompt
when a stream coalesces (``merge_deltas``)."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any, Protocol

from deepinfer.runtime.sampling_params import SamplingParams
from deepinfer.serve.engine_thread import RequestDelta, RequestFailed, SampleDelta
from deepinfer.serve.protocol import APIError


class DeltaSink(asyncio.Queue[Any]):
    """The queue of one HTTP request's deltas: unbounded, read by its handler alone. The same
    methods as ``asyncio.Queue`` without the task accounting and the waiter queues (a put and a
    get per token and stream: asyncio.Queue's cost ~10 Python calls a token)."""

    def __init__(self) -> None:
        super().__init__()
        self._items: deque[Any] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def qsize(self) -> int:
        return len(self._items)

    def empty(self) -> bool:
        return not self._items

    def full(self) -> bool:
        return False

    def put_nowait(self, item: Any) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def get_nowait(self) -> Any:
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    async def get(self) -> Any:
        while not self._items:
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                if self._waiter is waiter:  # (cancelled while waiting)
                    self._waiter = None
        return self._items.popleft()


class RequestSubmitter(Protocol):
    """An engine as the routes see it (``EngineThread``, ``ReplicaSet``, ``EngineClient``)."""

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, sink: asyncio.Queue[Any],
               tag: int, prompt_embeds: Any = None, priority: int = 0, cache_salt: str | None = None) -> None: ...

    def abort(self, request_id: str) -> None: ...


class Admission(Protocol):
    """What an ``EngineRun`` uses of the routes' ``ServingState`` (which imports this module)."""

    in_flight: int

    @property
    def engine(self) -> RequestSubmitter: ...


class EngineRun:
    """The engine requests of one HTTP request: an async iterator of their deltas.

    ``close()`` (idempotent, also on garbage collection) aborts whatever has not finished and
    gives the admission slots back; every path out of a handler calls it. ``state``: the routes'
    ``ServingState`` (its ``engine`` and ``in_flight``).
    """

    def __init__(self, state: Admission, request_id: str, prompts: list[list[int]],
                 params: list[SamplingParams], embeds: list[Any] | None = None, priority: int = 0,
                 cache_salt: str | None = None) -> None:
        self._state = state
        self._count = len(prompts)
        self._sink: asyncio.Queue[Any] = DeltaSink()
        self._ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        self._unfinished = set(self._ids)
        self._closed = False
        self._failure: APIError | None = None
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            state.engine.submit(self._ids[i], p, sp, self._sink, i, prompt_embeds=None if embeds is None else embeds[i],
                                priority=priority, cache_salt=cache_salt)

    @property
    def sink(self) -> asyncio.Queue[Any]:
        return self._sink

    @property
    def request_ids(self) -> list[str]:
        """The engine request ids, one per prompt."""
        return self._ids

    def __aiter__(self) -> EngineRun:
        return self

    async def __anext__(self) -> RequestDelta:
        if not self._unfinished:
            self.close()
            raise StopAsyncIteration
        item = await self._sink.get()
        if isinstance(item, RequestFailed):
            self._unfinished.discard(self._ids[item.tag])
            self.close()
            raise APIError(item.status, item.message)
        if item.finished:
            self._unfinished.discard(self._ids[item.tag])
        return item

    # --- coalesced streams (issue 25) ---
    async def batch(self, min_tokens: int = 1) -> list[RequestDelta]:
        """Every delta available now, merged per prompt (one delta per prompt with all its new
        tokens), waiting until they hold ``min_tokens`` new tokens or every request has ended;
        [] at the end. A failure raises its APIError after the deltas before it were returned."""
        items: list[RequestDelta] = []
        tokens = 0
        while True:
            try:
                got = await self.take()
            except APIError as err:
                if not items:
                    raise
                self._failure = err
                return merge_deltas(items)
            items += got
            tokens += sum(len(smp.token_ids) for item in got for smp in item.samples)
            if not got or tokens >= min_tokens or not self._unfinished:
                return merge_deltas(items)

    async def take(self) -> list[Any]:
        """Everything in the sink now, as it came (SSE events as bytes from a ``TokenStream``,
        deltas), waiting for one; [] at the end. A failure raises its APIError after the items
        before it were returned."""
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure
        if not self._unfinished:
            self.close()
            return []
        items: list[Any] = []
        item = await self._sink.get()
        while True:
            if isinstance(item, RequestFailed):
                self._unfinished.discard(self._ids[item.tag])
                self.close()
                err = APIError(item.status, item.message)
                if not items:
                    raise err
                self._failure = err
                return items
            items.append(item)
            if isinstance(item, RequestDelta) and item.finished:
                self._unfinished.discard(self._ids[item.tag])
            if self._sink.empty():
                return items
            item = self._sink.get_nowait()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for rid in self._unfinished:
            self._state.engine.abort(rid)
        self._unfinished.clear()
        self._state.in_flight -= self._count

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - __del__ must not raise (e.g. at interpreter exit)
            pass


def merge_deltas(items: list[RequestDelta]) -> list[RequestDelta]:
    """Consecutive deltas of one HTTP request merged per prompt (tag), in order: each sample's
    tokens, text and logprobs joined, its finish reason the last one given. One delta comes back
    as it is (nothing merges into it: no copy, the common case of a stream that keeps up)."""
    if len(items) == 1:
        return items
    merged: dict[int, RequestDelta] = {}
    for d in items:
        m = merged.get(d.tag)
        if m is None:
            merged[d.tag] = RequestDelta(d.tag, [_copy_sample(x) for x in d.samples], d.finished,
                                         None if d.prompt_logprobs is None else list(d.prompt_logprobs),
                                         d.cached_tokens)
            continue
        by_index = {x.index: x for x in m.samples}
        for x in d.samples:
            t = by_index.get(x.index)
            if t is None:
                m.samples.append(_copy_sample(x))
                continue
            t.token_ids.extend(x.token_ids)
            t.text += x.text
            if x.logprobs is not None:
                t.logprobs = (t.logprobs or []) + list(x.logprobs)
            if x.finish_reason is not None:
                t.finish_reason, t.stop_reason = x.finish_reason, x.stop_reason
        if d.prompt_logprobs:
            m.prompt_logprobs = (m.prompt_logprobs or []) + list(d.prompt_logprobs)
        if d.finished:
            m.finished = True
            m.cached_tokens = d.cached_tokens
    return list(merged.values())


def _copy_sample(x: SampleDelta) -> SampleDelta:
    return SampleDelta(x.index, list(x.token_ids), x.text, None if x.logprobs is None else list(x.logprobs),
                       x.finish_reason, x.stop_reason)

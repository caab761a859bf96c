"""Reference continuous-batching scheduler (mirrors the rules of the C++ Scheduler, written for
clarity: lists, dicts, recomputed totals).

Rules:
- running sequences are kept in precedence order: (priority, arrival, seq id) under the
  'priority' policy, (arrival, seq id) under 'fcfs'. Each step walks them in that order; a
  decode needs 1 token, a prefill the rest of its tokens (capped by the per-step threshold and the
  remaining budget). When blocks run out, the last running sequence (least important) is
  preempted (recompute), possibly the current one, which ends the walk.
- then, only if nothing was preempted: sequences are admitted in precedence order — the fronts of
  the preempted and the waiting queues compete by priority (under 'priority'), a preempted one
  winning ties — while the budget, max_num_seqs (an unforked n > 1 request counts n) and the
  watermark allow; the first that does not fit stops admission. Prompts longer than max_model_len
  are finished as ignored. A prefix-cache hit covers whole blocks, never the last token.
- decodes are listed before prefill chunks. A chunk that completes the sequence samples: n rows
  for an n > 1 prompt (children forked in update), else 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .block_manager import RefBlockManager

WAITING, RUNNING, PREEMPTED, STOPPED, LENGTH, ABORTED, IGNORED = range(7)


@dataclass
class RefSeq:
    seq_id: int
    group: RefGroup
    sample_index: int
    tokens: list[int]
    num_prompt: int
    status: int = WAITING
    num_computed: int = 0
    num_cached: int = 0
    registered: int = 0
    table: list[int] = field(default_factory=list)
    stop_token: int = -1

    @property
    def num_out(self) -> int:
        return len(self.tokens) - self.num_prompt


@dataclass
class RefGroup:
    request_id: str
    params: dict
    arrival: int
    eos: int
    seqs: list[RefSeq] = field(default_factory=list)
    forked: bool = False


class RefScheduler:
    def __init__(
        self,
        *,
        num_blocks,
        block_size,
        max_num_seqs,
        max_num_batched_tokens,
        max_model_len,
        eos_token_id=-1,
        enable_chunked_prefill=True,
        long_prefill_token_threshold=0,
        policy="fcfs",
        enable_prefix_caching=True,
        watermark=0.01,
        num_lookahead_slots=0,
    ):
        self.bs = block_size
        self.max_num_seqs = max_num_seqs
        self.max_batched = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos = eos_token_id
        self.chunked = enable_chunked_prefill
        self.threshold = long_prefill_token_threshold
        self.priority = policy == "priority"
        self.lookahead = num_lookahead_slots
        self.bm = RefBlockManager(
            num_blocks, block_size, enable_prefix_caching, int(watermark * num_blocks)
        )
        self.running: list[RefSeq] = []
        self.waiting: list[RefSeq] = []
        self.preempted: list[RefSeq] = []
        self.groups: dict[str, RefGroup] = {}
        self.next_seq_id = 0
        self.arrivals = 0
        self.scheduled = []  # (seq, n, computed_before, samples, is_prefill) of the step in flight
        self.in_flight = False
        self.finished: list[tuple[int, int]] = []  # (seq id, status) reported for the current step
        self.deferred: list[
            tuple[int, int]
        ] = []  # finished while no step ran: reported with the next

    # -- helpers
    def key(self, s: RefSeq):
        g = s.group
        return (g.params.get("priority", 0) if self.priority else 0, g.arrival, s.seq_id)

    def cost(self, s: RefSeq) -> int:
        n = s.group.params.get("n", 1)
        return n if (not s.group.forked and n > 1 and s.sample_index == 0) else 1

    def units(self) -> int:
        return sum(self.cost(s) for s in self.running)

    def _insert(self, lst: list[RefSeq], s: RefSeq) -> None:
        lst.append(s)
        lst.sort(key=self.key)

    def _new_seq(self, group, tokens, num_prompt, sample_index) -> RefSeq:
        s = RefSeq(self.next_seq_id, group, sample_index, list(tokens), num_prompt)
        self.next_seq_id += 1
        group.seqs.append(s)
        return s

    # -- requests
    def add_request(self, request_id, prompt, eos=None, **params) -> int:
        g = RefGroup(request_id, params, self.arrivals, self.eos if eos is None else eos)
        self.arrivals += 1
        self.groups[request_id] = g
        s = self._new_seq(g, prompt, len(prompt), 0)
        self._insert(self.waiting, s)
        return s.seq_id

    def _finish(self, s: RefSeq, status: int) -> None:
        s.status = status
        self.bm.free_table(s.table)
        (self.finished if self.in_flight else self.deferred).append((s.seq_id, status))

    def abort(self, request_id: str) -> None:
        for s in self.groups[request_id].seqs:
            if s.status >= STOPPED:
                continue
            for lst in (self.running, self.waiting, self.preempted):
                if s in lst:
                    lst.remove(s)
            self._finish(s, ABORTED)

    def _preempt(self, s: RefSeq) -> None:
        self.running.remove(s)
        self.bm.free_table(s.table)
        s.num_computed = 0
        s.registered = 0
        s.status = PREEMPTED
        self._insert(self.preempted, s)
        self.step_preempted.append(s.seq_id)

    # -- one step
    def schedule(self) -> dict:
        self.finished, self.deferred = self.deferred, []
        self.in_flight = True
        self.step_preempted = []
        ignored = []
        budget = self.max_batched
        decodes, prefills = [], []
        i = 0
        while i < len(self.running) and budget > 0:
            s = self.running[i]
            # a prompt's last token is a prefill too: it completes the prompt (n rows for n > 1)
            prefill = s.num_computed < len(s.tokens) - 1 or (s.num_out == 0 and s.num_computed < len(s.tokens))
            if prefill:
                n = len(s.tokens) - s.num_computed
                if self.threshold:
                    n = min(n, self.threshold)
                n = min(n, budget)
            else:
                n = 1
            slots = s.num_computed + n + (0 if prefill else self.lookahead)
            gone = False
            while not self.bm.ensure_slots(s.table, s.num_computed, slots):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is s:
                    gone = True
                    break
            if gone:
                break
            completes = s.num_computed + n >= len(s.tokens)
            samples = 0
            if completes:
                samples = self.cost(s) if (prefill and s.num_out == 0) else 1
            (prefills if prefill else decodes).append((s, n, s.num_computed, samples, prefill))
            budget -= n
            i += 1

        while not self.step_preempted and budget > 0 and (self.preempted or self.waiting):
            from_preempted = bool(self.preempted)
            if from_preempted and self.waiting and self.priority:
                # the queue fronts compete by priority; a preempted sequence wins ties
                prio = lambda q: q[0].group.params.get("priority", 0)  # noqa: E731
                from_preempted = prio(self.waiting) >= prio(self.preempted)
            queue = self.preempted if from_preempted else self.waiting
            s = queue[0]
            if not from_preempted and s.num_prompt > self.max_model_len:
                queue.pop(0)
                ignored.append(s.seq_id)
                self._finish(s, IGNORED)
                continue
            if self.units() + self.cost(s) > self.max_num_seqs:
                break
            hits = self.bm.match(s.tokens, (len(s.tokens) - 1) // self.bs)
            computed = len(hits) * self.bs
            n = len(s.tokens) - computed
            if self.chunked:
                if self.threshold:
                    n = min(n, self.threshold)
                n = min(n, budget)
            elif n > budget:
                break
            taken = (
                self.bm.blocks_for(computed + n)
                - len(hits)
                + sum(self.bm.ref[b] == 0 for b in hits)
            )
            if self.bm.num_free() - taken < self.bm.watermark_blocks:
                break
            queue.pop(0)
            if self.bm.prefix_caching:
                self.bm.queries += len(s.tokens)
                self.bm.hits += computed
            self.bm.acquire(hits, s.table)
            assert self.bm.ensure_slots(s.table, computed, computed + n)
            s.num_computed = s.num_cached = computed
            s.registered = len(hits)
            s.status = RUNNING
            samples = 0
            if computed + n >= len(s.tokens):
                samples = 1 if s.num_out else self.cost(s)
            prefills.append((s, n, computed, samples, True))
            budget -= n
            self._insert(self.running, s)

        self.scheduled = decodes + prefills
        return {
            "scheduled": [(s.seq_id, n, c, k, p) for s, n, c, k, p in self.scheduled],
            "preempted": list(self.step_preempted),
            "ignored": ignored,
        }

    # -- the update
    def _append(self, s: RefSeq, token: int) -> None:
        s.tokens.append(token)
        p = s.group.params
        status = None
        if s.num_out >= p.get("min_tokens", 0):
            if not p.get("ignore_eos", False) and s.group.eos >= 0 and token == s.group.eos:
                status = STOPPED
            elif token in (p.get("stop_token_ids") or ()):
                status = STOPPED
                s.stop_token = token
        if status is None and (
            s.num_out >= p.get("max_tokens", 16) or len(s.tokens) >= self.max_model_len
        ):
            status = LENGTH
        if status is not None:
            self._finish(s, status)

    def update(self, tokens: list[int]) -> None:
        row = 0
        for s, n, _, samples, _ in self.scheduled:
            if s.status >= STOPPED:
                row += samples
                continue
            s.num_computed += n
            full = min(s.num_computed, len(s.tokens)) // self.bs
            if full > s.registered:
                s.registered = self.bm.register(s.table, s.tokens, s.registered, full)
            if samples == 0:
                continue
            children = []
            if samples > 1:
                s.group.forked = True
                for _ in range(samples - 1):
                    c = self._new_seq(s.group, s.tokens, s.num_prompt, len(s.group.seqs))
                    c.status = RUNNING
                    c.num_computed = s.num_computed
                    c.num_cached = s.num_cached
                    c.registered = min(s.registered, s.num_computed // self.bs)
                    c.table = self.bm.fork_table(s.table, s.num_computed)
                    self._insert(self.running, c)
                    children.append(c)
            self._append(s, tokens[row])
            for j, c in enumerate(children):
                self._append(c, tokens[row + 1 + j])
            row += samples
        self.running = [s for s in self.running if s.status == RUNNING]
        self.scheduled = []
        self.in_flight = False

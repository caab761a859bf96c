"""Run one engine step's model inputs through the model over the paged KV cache."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from deepinfer.runtime.attention.metadata import build_attention_metadata
from deepinfer.runtime.host_to_device import host_to_device
from deepinfer.runtime.loading.model_loader import LoadedModel
from deepinfer.runtime.worker.kv_cache import allocate_kv_caches

if TYPE_CHECKING:
    from deepinfer.runtime.worker.native_decode import NativeDecode


class DecodeGraphs(Protocol):
    """What the step executor needs of captured decode graphs (``cuda_graph_runner``
    implements it; the runner does not import that module, which builds on this one)."""

    batch_sizes: list[int]
    timer: Any

    def can_replay(self, args: Any) -> bool: ...

    def replay(self, rows: int, host: torch.Tensor | None = None,
               before_replay: Any | None = None) -> tuple[torch.Tensor, torch.Tensor]: ...


def select_attention(device: torch.device, backend: str | None = None, block_size: int = 16,  # type: ignore[no-untyped-def]
                     batch_invariant: bool = False):
    """The attention function for ``device``: ``"torch"`` (any device) or ``"triton"`` (CUDA;
    the default there when Triton is installed and block_size is a power of two >= 16).
    ``batch_invariant`` (CUDA): the Triton kernel with one tile shape for every step."""
    if backend is None:
        backend = "torch"
        if device.type == "cuda" and block_size >= 16 and block_size & (block_size - 1) == 0:
            try:
                import triton  # noqa: F401

                backend = "triton"
            except ImportError:
                pass
    choice = backend
    if choice == "torch":
        from deepinfer.runtime.attention.torch_paged import paged_attention

        return paged_attention
    if choice == "triton":
        if device.type != "cuda":
            raise ValueError(f"attention_backend='triton' needs a CUDA device, got {device}")
        if block_size < 16 or block_size & (block_size - 1):
            raise ValueError(f"attention_backend='triton' needs block_size a power of two >= 16, got {block_size}")
        from deepinfer.runtime.attention.triton_paged import paged_attention as triton_attention

        return functools.partial(triton_attention, batch_invariant=True) if batch_invariant else triton_attention
    raise ValueError(f"attention_backend must be 'torch' or 'triton', got {backend!r}")


def _fused_step_supported(model: Any, attention: Any) -> bool:
    try:  # (Triton: the fused kernels' compiler)
        from deepinfer.runtime.models.llama_fused_decode import fused_step_supported
    except ImportError:
        return False
    return fused_step_supported(model, attention)


def _set_torch_threads(n: int) -> None:
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


class ModelRunner:
    """Owns the model, its KV cache and the attention backend; ``execute`` runs one step."""

    def __init__(self, loaded: LoadedModel, *, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, attention_backend: str | None = None, deterministic: bool = False) -> None:
        self.model = loaded.model
        self.config = loaded.config
        self.device, self.dtype = device, dtype
        self.block_size, self.num_blocks = block_size, num_blocks
        self.kv_caches = allocate_kv_caches(self.config, num_blocks, block_size, dtype, device)
        self.scratch_slot = num_blocks * block_size  # first slot of the extra scratch block
        if deterministic and device.type == "cuda":
            self.attention = self._batch_invariant_cuda(attention_backend, block_size)
        else:
            self.attention = select_attention(device, attention_backend, block_size)
        # eager CUDA steps through the fused Triton kernels (models.llama_fused_decode.fused_step_forward)
        self.fused_steps: bool | None = None
        self.graphs: DecodeGraphs | None = None  # decode steps replayed from CUDA graphs, when captured
        # eager steps of up to a few hundred tokens replayed from CUDA graphs (worker.step_graph_runner)
        self.step_graphs: Any = None
        # speculative verify steps replayed from CUDA graphs (worker.verify_graph_runner), when captured
        self.verify_graphs: Any = None
        # CPU, float32 KV cache: decode-only steps run natively (models.native_decode), else None
        self.native_decode: NativeDecode | None = None
        # deterministic: every step on the native kernels, each row computed alone (batch invariance)
        self.deterministic = deterministic
        reason = f"device {device.type} with a {dtype} KV cache (the native kernels run on CPU, float32)"
        if device.type == "cpu" and dtype == torch.float32:
            from deepinfer.runtime.worker.native_decode import build_native_decode_explained

            self.native_decode, reason = build_native_decode_explained(self.model, loaded.gguf, self.kv_caches)
        # Prompt and mixed steps of up to this many rows run natively too (0: on torch): short
        # prompts of int4 files on CPUs below AVX-512, opt-in (worker.native_decode.native_prompt_rows).
        self.native_prompt_rows = 0
        if self.native_decode is not None and not deterministic:
            from deepinfer.runtime.worker.native_decode import native_prompt_rows

            self.native_prompt_rows = native_prompt_rows(self.model)
        if deterministic and device.type != "cuda" and self.native_decode is None:
            raise ValueError(f"deterministic=True: batch-invariant steps run on the native CPU kernels, which this "
                             f"model cannot use: {reason}")
        # While steps run natively, torch runs on one thread: its OpenMP workers spin for a while
        # after every parallel region (libgomp's default wait policy), and spinning between native
        # steps takes a core from the native pool (measured: up to 3x slower batch-1 decode on two
        # cores). torch gets its thread count back for its own forward passes (prefill, mixed
        # steps) and when the engine runs out of work (restore_torch_threads).
        self.torch_threads = torch.get_num_threads()
        # ---- speculative decoding: steps whose rows are all decodes of at most this many tokens
        # (the last token + drafts) run on the native kernels too, one row per token, as decode
        # rows are (0: off; the engine loop sets k + 1 when speculation is configured).
        self.native_verify_tokens = 0

    def _batch_invariant_cuda(self, attention_backend: str | None, block_size: int):  # type: ignore[no-untyped-def]
        """deterministic=True on CUDA: the model's projections, norms and LM head on the
        batch-invariant Triton kernels, and the attention function with one tile shape."""
        if attention_backend not in (None, "triton"):
            raise ValueError(f"deterministic=True on CUDA runs the Triton attention kernel, not "
                             f"attention_backend={attention_backend!r}")
        try:
            import triton  # noqa: F401
        except ImportError as exc:
            raise ValueError("deterministic=True on CUDA needs Triton (it ships with torch's CUDA wheels: "
                             "pip install triton)") from exc
        use = getattr(self.model, "use_batch_invariant_kernels", None)
        if use is None:
            raise ValueError(f"deterministic=True on CUDA: {type(self.model).__name__} has no batch-invariant "
                             "kernels (Llama-family models have them)")
        use()
        return select_attention(self.device, "triton", block_size, batch_invariant=True)

    def restore_torch_threads(self) -> None:
        """Give torch its thread count back (the engine has no work left; see ``__init__``)."""
        if self.native_decode is not None:
            _set_torch_threads(self.torch_threads)

    def copy_blocks(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy KV blocks ``src[i]`` -> ``dst[i]`` in every layer (fork of a partial block)."""
        if len(src) == 0:
            return
        s = torch.as_tensor(np.asarray(src, dtype=np.int64), device=self.device)
        d = torch.as_tensor(np.asarray(dst, dtype=np.int64), device=self.device)
        for cache in self.kv_caches:
            cache[:, d] = cache[:, s]

    def _is_verify_step(self, query_start_loc: np.ndarray, seq_lens: np.ndarray) -> bool:
        # every row a decode (it has context before its new tokens) of at most native_verify_tokens
        qsl = np.asarray(query_start_loc)
        q = np.diff(qsl)
        lens = np.asarray(seq_lens)[:len(q)]
        return bool(len(q) and q.max() <= self.native_verify_tokens and (lens > q).all())

    @torch.inference_mode()
    def execute(self, *, input_ids: np.ndarray | torch.Tensor, positions: np.ndarray, slot_mapping: np.ndarray,
                query_start_loc: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray,
                logits_indices: np.ndarray, prompt_embeds: tuple[np.ndarray, torch.Tensor] | None = None
                ) -> torch.Tensor:
        """Float32 logits [len(logits_indices), vocab] for one step in the var-len layout.

        ``prompt_embeds``: (token rows, their input embeddings [rows, hidden]) that replace those
        rows' token embeddings (prompts given as embeddings); such steps run the eager forward."""
        num_rows = len(input_ids)
        if prompt_embeds is not None:
            return self._execute_eager(input_ids, positions, slot_mapping, query_start_loc, seq_lens, block_tables,
                                       logits_indices, prompt_embeds)
        if self.deterministic and self.native_decode is not None:
            # every step natively, one row per token (prompt chunks too): batch-invariant logits
            _set_torch_threads(1)
            host_ids = input_ids.cpu().numpy() if isinstance(input_ids, torch.Tensor) else input_ids
            return self.native_decode.step(host_ids, positions, slot_mapping, query_start_loc, seq_lens,
                                           block_tables, logits_indices)
        if (self.native_decode is not None and num_rows == len(seq_lens)
                and np.array_equal(query_start_loc, np.arange(num_rows + 1))):
            # decode-only step (one token per sequence, no padding rows): one native call
            _set_torch_threads(1)
            host_ids = input_ids.cpu().numpy() if isinstance(input_ids, torch.Tensor) else input_ids
            logits = self.native_decode(host_ids, positions, slot_mapping, seq_lens, block_tables)
            picked = np.asarray(logits_indices)
            return logits if np.array_equal(picked, np.arange(num_rows)) else logits[torch.from_numpy(
                np.ascontiguousarray(picked, dtype=np.int64))]
        if self.native_decode is not None and self.native_verify_tokens and self._is_verify_step(
                query_start_loc, seq_lens):
            _set_torch_threads(1)  # ---- speculative decoding: a verify step, natively
            host_ids = input_ids.cpu().numpy() if isinstance(input_ids, torch.Tensor) else input_ids
            return self.native_decode.step(host_ids, positions, slot_mapping, query_start_loc, seq_lens,
                                           block_tables, logits_indices)
        if self.native_decode is not None and self.native_prompt_rows and num_rows <= self.native_prompt_rows:
            _set_torch_threads(1)  # a short prompt or mixed step, natively (one row per token)
            host_ids = input_ids.cpu().numpy() if isinstance(input_ids, torch.Tensor) else input_ids
            return self.native_decode.step(host_ids, positions, slot_mapping, query_start_loc, seq_lens,
                                           block_tables, logits_indices)
        return self._execute_eager(input_ids, positions, slot_mapping, query_start_loc, seq_lens, block_tables,
                                   logits_indices)

    def _execute_eager(self, input_ids: np.ndarray | torch.Tensor, positions: np.ndarray, slot_mapping: np.ndarray,
                       query_start_loc: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray,
                       logits_indices: np.ndarray, prompt_embeds: tuple[np.ndarray, torch.Tensor] | None = None
                       ) -> torch.Tensor:
        if self.native_decode is not None:
            _set_torch_threads(self.torch_threads)
        if prompt_embeds is None and self.step_graphs is not None and self.step_graphs.fits(
                len(positions), len(seq_lens)):
            hidden = self.step_graphs.run(input_ids, positions, slot_mapping, query_start_loc, seq_lens, block_tables)
        else:
            hidden = self._eager_hidden(input_ids, positions, slot_mapping, query_start_loc, seq_lens, block_tables,
                                        prompt_embeds)
        rows = host_to_device(logits_indices, self.device)
        return self.model.compute_logits(hidden[rows])

    def _eager_hidden(self, input_ids: np.ndarray | torch.Tensor, positions: np.ndarray, slot_mapping: np.ndarray,
                      query_start_loc: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray,
                      prompt_embeds: tuple[np.ndarray, torch.Tensor] | None) -> torch.Tensor:
        """The final hidden states of an eager step: the fused forward on CUDA where it runs this
        model, else the model's own."""
        meta = build_attention_metadata(
            slot_mapping=np.asarray(slot_mapping), query_start_loc=np.asarray(query_start_loc),
            seq_lens=np.asarray(seq_lens), block_tables=np.asarray(block_tables),
            block_size=self.block_size, scratch_slot=self.scratch_slot, device=self.device)
        if isinstance(input_ids, torch.Tensor):  # (the overlap loop's ids, gathered on the device)
            ids = input_ids.to(device=self.device, dtype=torch.int64)
        else:
            ids = host_to_device(input_ids, self.device)
        pos = host_to_device(positions, self.device)
        embeds = None
        if prompt_embeds is not None:
            at, values = prompt_embeds
            embeds = self.model.embed_tokens(ids)
            embeds[host_to_device(at, self.device)] = \
                values.to(device=self.device, dtype=embeds.dtype)
        if self.fused_steps is None:  # decided at the first eager step (the loader may swap layers before)
            self.fused_steps = self.device.type == "cuda" and _fused_step_supported(self.model, self.attention)
        if self.fused_steps:
            from deepinfer.runtime.models.llama_fused_decode import fused_step_forward

            return fused_step_forward(self.model, ids, pos, self.kv_caches, meta, inputs_embeds=embeds)
        return self.model(ids, pos, self.kv_caches, meta, self.attention, inputs_embeds=embeds)

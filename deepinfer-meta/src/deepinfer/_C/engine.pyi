"""``deepinfer._C.engine``: the C++ engine API, as seen from Python (wheel ``deepinfer-engine``).

35 names: 20 classes, 2 enums, 12 functions, 1 constant. The rules below hold for every
name; docs/api/engine-core.md and docs/api/engine-inputs.md document each name.

Borrowed memory
    A borrowed buffer is a numpy array (possibly a view of a pinned torch tensor,
    ``tensor.numpy()``) that a call reads or writes in place: never copied, never kept
    beyond the call (except ``PrepareArgs``, which holds its output buffers for its
    lifetime). Every borrowed buffer is validated before anything is written: wrong dtype
    is a ``TypeError``; wrong ndim/shape, too small a capacity, a non-C-contiguous or
    read-only buffer that must be written is a ``ValueError``; the message names the
    argument. A rejected call writes nothing and leaves the engine's state unchanged.

    ==========================================  =======  ================================
    argument                                    dtype    shape
    ==========================================  =======  ================================
    Scheduler.update: sampled_token_ids         integer  (R,)  R = out.num_sample_rows [1]
    Scheduler.update: logprobs                  float32  (R,)
    Scheduler.update: topk_token_ids/logprobs   int32/f32 (R, k)
    PrepareArgs: input_ids                      int32    (T,)  T = token capacity
    PrepareArgs: positions, logits_indices      int32    (>=T,)
    PrepareArgs: slot_mapping                   int64    (>=T,)
    PrepareArgs: query_start_loc                int32    (>=S+1,)  S = block_tables rows
    PrepareArgs: seq_lens                       int32    (>=S,)
    PrepareArgs: block_tables                   int32    (S, W)
    PrepareArgs: yoco_kept_rows / cu_seqlens    int32    (>=T,) / (>=S+1,)
    PrepareArgs: engram_indices                 int32    (>=T, layers*orders*heads)
    PrepareArgs: zos_source_index               int32    (>=T,)
    encode_compressed: out                      int32    (>=n,)
    process_MTPInfo: num_accepted               int32    (R,)   (read)
    process_MTPInfo: output_tokens              int32    (R, C) (read)
    process_MTPInfo: next_drafts                int32    (R, k) (read)
    process_MTPInfo: logprobs                   float32  (R, C) (read)
    process_MTPInfo: topk ids/logprobs          int32/f32 (R, C, K) (read)
    update_prompt_logprobs: logprobs            float32  (N,)   (read)
    update_prompt_logprobs: topk ids/logprobs   int32/f32 (N, k) (read)
    ==========================================  =======  ================================

    [1] int32 C-contiguous is borrowed; any other integer array, a CPU tensor (DLPack) or a
    list is converted once (a non-integer dtype is a ``TypeError``).

Calls that release the GIL
    ``Scheduler.schedule``, ``Scheduler.update``, ``prepare_prompt_v4``,
    ``prepare_decode_v4``, ``prepare_zos_inputs``, ``prepare_decode_zos_inputs``,
    ``prepare_sampler_inputs``, ``process_MTPInfo``, ``Scheduler.abandon_step``,
    ``encode_compressed``. Calls that create Python objects (``build_request_outputs``,
    ``get_finished_seqs_info``, property getters) hold the GIL.

One thread at a time per object
    A scheduler (and the pools, ``PrepareArgs`` and ``SamplerInputs`` used with it) is
    driven by one thread at a time; the engine takes no lock. A call that would mutate a
    ``Scheduler``, ``SequenceMetadataPool``, ``PrepareArgs`` or ``SamplerInputs`` while
    another thread's call is inside it (the calls above release the GIL) raises
    ``RuntimeError("<object> is being used by another thread: ...")`` at once and changes
    nothing: every mutating call (``add_request``, ``abort_request``, ``schedule``,
    ``update``, ``abandon_step``, ``stop_sequence``, ``reset_prefix_cache``, the builders,
    ``SequenceMetadataPool.build`` / ``add_sequence`` / ``clear``,
    ``clone_and_zero_states_and_blocks``, ``process_MTPInfo``, ``update_prompt_logprobs``,
    ``build_request_outputs``, ``get_finished_seqs_info``) holds its objects' busy flag
    (one atomic exchange each) for its duration. Read-only properties are not guarded: read
    them from the thread that drives the object.

Loose types
    Parameters shown as ``typing.Any`` below take a list of ints or any integer numpy
    array (converted once, validated element by element): ``Scheduler.add_request``'s
    ``prompt_token_ids``; ``SamplingParams``' ``stop_token_ids``, ``allowed_token_ids``,
    ``banned_token_ids`` (and per word ``bad_words_token_ids``), also when assigned;
    ``SequenceMetadataPool.add_sequence``'s ``token_ids``, ``block_table``,
    ``draft_tokens``;
    ``PrepareArgs``'s ``graph_batch_sizes``, ``engram_ngram_orders``,
    ``engram_layer_seeds`` (unsigned 64-bit), ``engram_table_sizes``;
    ``PrepareArgs.zos_discard``'s ``finished_seq_ids``; ``set_engram_lookup_table``'s
    ``table``; ``encode_compressed``'s ``token_ids``; ``FlopsEstimator.step_flops``'s
    ``query_lens`` and ``context_lens``. ``SamplingParams.logit_bias`` is a dict
    ``{token_id: bias}``; a bool is refused where an int or a float is expected.

Returned arrays are fresh numpy arrays owned by the caller. Generated by
scripts/gen_stubs.py (pybind11-stubgen); edit the header in scripts/stub_headers/.
"""

from __future__ import annotations
import collections.abc
import enum
import numpy
import numpy.typing
import typing
__all__: list[str] = ['BlockManager', 'DecodeSamplingInputs', 'DriverSamplingInputs', 'FlopsEstimator', 'LogitsTransformInputs', 'PLACEHOLDER_REQUEST_ID', 'PrefillSamplingInputs', 'PrepareArgs', 'PromptLogprobInputs', 'RequestOutput', 'RequestOutputPool', 'SamplerInputs', 'SamplingKernelInputs', 'SamplingParams', 'Scheduler', 'SchedulerOutputs', 'Sequence', 'SequenceData', 'SequenceMetadata', 'SequenceMetadataPool', 'SequenceStatus', 'SpeculativeSamplingInputs', 'YocoPrefillTruncationMode', 'build_request_outputs', 'clone_and_zero_states_and_blocks', 'encode_compressed', 'get_finished_seqs_info', 'prepare_decode_v4', 'prepare_decode_zos_inputs', 'prepare_prompt_v4', 'prepare_sampler_inputs', 'prepare_zos_inputs', 'process_MTPInfo', 'set_engram_lookup_table', 'update_prompt_logprobs']
class SamplingParams:
    """
    A request's sampling parameters as the engine holds them (vLLM's names and defaults), taken by
    Scheduler.add_request and SequenceMetadataPool.add_sequence. Every rule lives in the C++
    SamplingParams::validate: the constructor and every property assignment check the value and
    raise TypeError (wrong type: bool where an int or float is expected, a string for a token
    list...) or ValueError (out of bounds), the message starting with the field's name
    ("temperature: -0.5 must be a finite value >= 0"); a refused assignment changes nothing.
    Numbers may be Python or numpy scalars; token-id lists may be lists, tuples or 1-D integer
    numpy arrays. validate(vocab_size) also bounds the token ids by a vocabulary (add_request does).
    deepinfer.SamplingParams (the runtime's) holds one of these for every field the engine uses.
    """
    FIELDS: typing.ClassVar[tuple] = ('n', 'temperature', 'top_p', 'top_k', 'min_p', 'presence_penalty', 'frequency_penalty', 'repetition_penalty', 'seed', 'stop_token_ids', 'ignore_eos', 'max_tokens', 'min_tokens', 'logprobs', 'prompt_logprobs', 'logit_bias', 'allowed_token_ids', 'banned_token_ids', 'bad_words_token_ids')
    __hash__: typing.ClassVar[None] = None  # type: ignore[assignment]
    def __copy__(self) -> SamplingParams:
        ...
    def __deepcopy__(self, memo: typing.Any) -> SamplingParams:
        ...
    def __eq__(self, arg0: SamplingParams) -> bool:  # type: ignore[override]
        ...
    def __getstate__(self) -> dict:
        ...
    def __init__(self, *, n: int = 1, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1, min_p: float = 0.0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0, repetition_penalty: float = 1.0, seed: int | None = None, stop_token_ids: typing.Any = None, ignore_eos: bool = False, max_tokens: int = 16, min_tokens: int = 0, logprobs: int | None = None, prompt_logprobs: int | None = None, logit_bias: dict[int, float] | None = None, allowed_token_ids: typing.Any = None, banned_token_ids: typing.Any = None, bad_words_token_ids: typing.Any = None) -> None:
        """
        Keyword arguments only; see the class docstring.
        """
    def __repr__(self) -> str:
        ...
    def __setstate__(self, arg0: dict) -> None:
        ...
    def replace(self, **kwargs) -> SamplingParams:
        """
        A validated copy with the given fields changed (keyword arguments as in the constructor).
        """
    def validate(self, vocab_size: typing.SupportsInt | typing.SupportsIndex = 0) -> None:
        """
        Check every field again, token ids against [0, vocab_size) and logprob counts against vocab_size (0: no vocabulary). Raises ValueError naming the field.
        """
    @property
    def allowed_token_ids(self) -> list[int] | None:
        """
        list[int] | None: only these tokens may be sampled (sorted, unique); None = every token.
        """
    @allowed_token_ids.setter
    def allowed_token_ids(self, arg1: typing.Any) -> None:
        ...
    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        """
        list[list[int]]: vLLM's bad words as token sequences: the token that would complete one is never sampled (a one-token word: always; a longer word: when the output ends with its other tokens).
        """
    @bad_words_token_ids.setter
    def bad_words_token_ids(self, arg1: typing.Any) -> None:
        ...
    @property
    def banned_token_ids(self) -> list[int]:
        """
        list[int]: tokens never sampled (sorted, unique).
        """
    @banned_token_ids.setter
    def banned_token_ids(self, arg1: typing.Any) -> None:
        ...
    @property
    def frequency_penalty(self) -> float:
        """
        float in [-2, 2]: subtracted per occurrence in the output.
        """
    @frequency_penalty.setter
    def frequency_penalty(self, arg1: typing.Any) -> None:
        ...
    @property
    def ignore_eos(self) -> bool:
        """
        bool: keep generating after the end-of-sequence token.
        """
    @ignore_eos.setter
    def ignore_eos(self, arg1: typing.Any) -> None:
        ...
    @property
    def logit_bias(self) -> dict[int, float]:
        """
        dict[int, float]: bias in [-100, 100] added to a token's logit before sampling.
        """
    @logit_bias.setter
    def logit_bias(self, arg1: typing.Any) -> None:
        ...
    @property
    def logprobs(self) -> int | None:
        """
        int | None: report the sampled token's logprob and the top-k (0..20).
        """
    @logprobs.setter
    def logprobs(self, arg1: typing.Any) -> None:
        ...
    @property
    def max_tokens(self) -> int:
        """
        int >= 1: most tokens to generate.
        """
    @max_tokens.setter
    def max_tokens(self, arg1: typing.Any) -> None:
        ...
    @property
    def min_p(self) -> float:
        """
        float in [0, 1]: drop tokens less likely than min_p times the most likely.
        """
    @min_p.setter
    def min_p(self, arg1: typing.Any) -> None:
        ...
    @property
    def min_tokens(self) -> int:
        """
        int in [0, max_tokens]: no EOS or stop token id ends a completion before.
        """
    @min_tokens.setter
    def min_tokens(self, arg1: typing.Any) -> None:
        ...
    @property
    def n(self) -> int:
        """
        int: samples per prompt, >= 1 (they share the prompt's KV blocks).
        """
    @n.setter
    def n(self, arg1: typing.Any) -> None:
        ...
    @property
    def presence_penalty(self) -> float:
        """
        float in [-2, 2]: subtracted once from tokens already generated.
        """
    @presence_penalty.setter
    def presence_penalty(self, arg1: typing.Any) -> None:
        ...
    @property
    def prompt_logprobs(self) -> int | None:
        """
        int | None: report each prompt token's logprob and the top-k (0..20).
        """
    @prompt_logprobs.setter
    def prompt_logprobs(self, arg1: typing.Any) -> None:
        ...
    @property
    def repetition_penalty(self) -> float:
        """
        float > 0: logits of tokens seen in prompt or output divided (positive) or multiplied (negative) by it; 1 = off.
        """
    @repetition_penalty.setter
    def repetition_penalty(self, arg1: typing.Any) -> None:
        ...
    @property
    def seed(self) -> int | None:
        """
        int | None: the request's RNG seed (int64); None derives one from the sampler's seed.
        """
    @seed.setter
    def seed(self, arg1: typing.Any) -> None:
        ...
    @property
    def stop_token_ids(self) -> list[int]:
        """
        list[int]: token ids that end a completion (sorted, unique).
        """
    @stop_token_ids.setter
    def stop_token_ids(self, arg1: typing.Any) -> None:
        ...
    @property
    def temperature(self) -> float:
        """
        float: >= 0; 0 = greedy, else logits are divided by it.
        """
    @temperature.setter
    def temperature(self, arg1: typing.Any) -> None:
        ...
    @property
    def top_k(self) -> int:
        """
        int: keep the k most likely tokens; -1 = off (0 is refused here).
        """
    @top_k.setter
    def top_k(self, arg1: typing.Any) -> None:
        ...
    @property
    def top_p(self) -> float:
        """
        float in (0, 1]: keep the smallest set of tokens reaching this probability.
        """
    @top_p.setter
    def top_p(self, arg1: typing.Any) -> None:
        ...
class SequenceStatus(enum.IntEnum):
    """
    Lifecycle of a sequence. FINISHED_* values are final.
    """
    FINISHED_ABORTED = ...
    FINISHED_ERROR = ...
    FINISHED_IGNORED = ...
    FINISHED_LENGTH = ...
    FINISHED_STOPPED = ...
    PREEMPTED = ...
    RUNNING = ...
    WAITING = ...
    @classmethod
    def __new__(cls, value):
        ...
    def __format__(self, format_spec):
        ...
class BlockManager:
    """
    The paged KV cache of a Scheduler (``Scheduler.block_manager``): ref-counted blocks, prefix caching verified against stored tokens, LRU eviction of cached free blocks, copy-on-write, watermark. Not constructible from Python.
    """
    def is_cached(self, block: typing.SupportsInt | typing.SupportsIndex) -> bool:
        """
        Whether a block is registered in the prefix cache.
        """
    def ref_count(self, block: typing.SupportsInt | typing.SupportsIndex) -> int:
        """
        Reference count of a block (number of block tables holding it).
        """
    @property
    def block_size(self) -> int:
        """
        Tokens per block.
        """
    @property
    def enable_prefix_caching(self) -> bool:
        """
        Prefix caching on.
        """
    @property
    def num_blocks(self) -> int:
        """
        Total KV blocks.
        """
    @property
    def num_cached_blocks(self) -> int:
        """
        Blocks registered in the prefix cache (free or in use).
        """
    @property
    def num_cow_copies(self) -> int:
        """
        Partial blocks copied (forks and copy-on-write).
        """
    @property
    def num_evictions(self) -> int:
        """
        Cached blocks evicted to serve allocations.
        """
    @property
    def num_free_blocks(self) -> int:
        """
        Free blocks (uncached + cached evictable).
        """
    @property
    def prefix_cache_hit_rate(self) -> float:
        """
        Prompt tokens served from the prefix cache / prompt tokens looked up, at admissions.
        """
    @property
    def usage(self) -> float:
        """
        Fraction of blocks in use.
        """
    @property
    def watermark_blocks(self) -> int:
        """
        Blocks kept free when admitting sequences.
        """
class SchedulerOutputs:
    """
    What one step runs, returned by Scheduler.schedule(). Owned by the scheduler and rewritten by the next schedule(): read it before that. Arrays are fresh copies. Scheduled entries: decodes first (``num_decodes`` of them), then prefill chunks.
    """
    def __len__(self) -> int:
        """
        Scheduled sequences.
        """
    @property
    def blocks_to_copy(self) -> numpy.typing.NDArray[numpy.int32]:
        """
        int32[k, 2]: (src, dst) KV blocks to copy before the forward.
        """
    @property
    def ignored_seq_ids(self) -> numpy.typing.NDArray[numpy.int64]:
        """
        int64: sequences finished as ignored (prompt too long) by this step.
        """
    @property
    def is_empty(self) -> bool:
        """
        Nothing scheduled.
        """
    @property
    def is_prefill(self) -> numpy.typing.NDArray[numpy.bool]:
        """
        bool[len]: prompt (or recompute) chunk rather than a decode.
        """
    @property
    def num_batched_tokens(self) -> int:
        """
        Tokens computed this step.
        """
    @property
    def num_computed_tokens(self) -> numpy.typing.NDArray[numpy.int32]:
        """
        int32[len]: computed tokens of each sequence before this step (its first position).
        """
    @property
    def num_decode_tokens(self) -> int:
        """
        Decode tokens (incl. drafts).
        """
    @property
    def num_decodes(self) -> int:
        """
        Entries [0, num_decodes) are decodes.
        """
    @property
    def num_prefill_tokens(self) -> int:
        """
        Prefill tokens this step.
        """
    @property
    def num_sample_rows(self) -> int:
        """
        Tokens Scheduler.update expects (sum of num_samples).
        """
    @property
    def num_samples(self) -> numpy.typing.NDArray[numpy.int32]:
        """
        int32[len]: sample rows per sequence (0 mid-prefill; n when an n > 1 prompt completes).
        """
    @property
    def num_scheduled_tokens(self) -> numpy.typing.NDArray[numpy.int32]:
        """
        int32[len]: tokens computed per scheduled sequence.
        """
    @property
    def preempted_seq_ids(self) -> numpy.typing.NDArray[numpy.int64]:
        """
        int64: sequences preempted (recompute) by this step.
        """
    @property
    def request_ids(self) -> list:
        """
        list[str]: the scheduled sequences' request ids.
        """
    @property
    def seq_ids(self) -> numpy.typing.NDArray[numpy.int64]:
        """
        int64[len]: the scheduled sequences' ids.
        """
    @property
    def states_to_clone(self) -> numpy.typing.NDArray[numpy.int32]:
        """
        int32[k, 2]: (src, dst) state slots to clone before the forward.
        """
    @property
    def states_to_zero(self) -> numpy.typing.NDArray[numpy.int32]:
        """
        int32[k]: state slots to zero before the forward.
        """
    @property
    def step(self) -> int:
        """
        Step number (1 for the first schedule()).
        """
class SequenceData:
    """
    Token data of one sequence (a view by seq id; reads copy). Raises ValueError once the sequence was released.
    """
    def get_len(self) -> int:
        """
        Prompt + output length.
        """
    def get_output_len(self) -> int:
        """
        Output length.
        """
    def get_prompt_len(self) -> int:
        """
        Prompt length.
        """
    @property
    def cumulative_logprob(self) -> float:
        """
        Sum of the sampled tokens' logprobs.
        """
    @property
    def num_computed_tokens(self) -> int:
        """
        Tokens whose KV is in the cache.
        """
    @property
    def output_token_ids(self) -> numpy.typing.NDArray[numpy.int32]:
        """
        int32 copy of the generated tokens.
        """
    @property
    def prompt_token_ids(self) -> numpy.typing.NDArray[numpy.int32]:
        """
        int32 copy of the prompt.
        """
    @property
    def token_ids(self) -> numpy.typing.NDArray[numpy.int32]:
        """
        int32 copy of prompt + outputs.
        """
class Sequence:
    """
    One sequence of a request (a view by seq id, from Scheduler.get_sequence / get_sequences). Reads copy; raises ValueError once the sequence was released.
    """
    def __repr__(self: Sequence) -> str:
        ...
    @property
    def arrival_time(self) -> float:
        """
        Arrival time (time.time() seconds).
        """
    @property
    def block_table(self) -> numpy.typing.NDArray[numpy.int32]:
        """
        int32 copy of its KV block ids.
        """
    @property
    def data(self) -> SequenceData:
        """
        Its SequenceData.
        """
    @property
    def draft_token_ids(self) -> numpy.typing.NDArray[numpy.int32]:
        """
        int32 copy of the drafts to verify next step.
        """
    @property
    def finish_reason(self) -> typing.Any:
        """
        'stop', 'length', 'abort', 'ignored', 'error' or None.
        """
    @property
    def is_finished(self) -> bool:
        """
        Whether its status is FINISHED_*.
        """
    @property
    def num_cached_tokens(self) -> int:
        """
        Prefix-cache hit tokens at its last admission.
        """
    @property
    def num_computed_tokens(self) -> int:
        """
        Tokens whose KV is in the cache.
        """
    @property
    def num_prompt_tokens(self) -> int:
        """
        Prompt length.
        """
    @property
    def num_tokens(self) -> int:
        """
        Prompt + output length.
        """
    @property
    def output_token_ids(self) -> numpy.typing.NDArray[numpy.int32]:
        """
        int32 copy of the generated tokens.
        """
    @property
    def priority(self) -> int:
        """
        Request priority (smaller = sooner).
        """
    @property
    def request_id(self) -> str:
        """
        Its request.
        """
    @property
    def sample_index(self) -> int:
        """
        Index among the request's n samples (0 = parent).
        """
    @property
    def seq_id(self) -> int:
        """
        Sequence id (unique, never reused).
        """
    @property
    def state_slot(self) -> int:
        """
        Recurrent-state slot, -1 when none.
        """
    @property
    def status(self) -> SequenceStatus:
        """
        SequenceStatus.
        """
    @property
    def stop_reason(self) -> typing.Any:
        """
        Stop token id (int), stop string or ignore reason (str), or None.
        """
    @property
    def token_ids(self) -> numpy.typing.NDArray[numpy.int32]:
        """
        int32 copy of prompt + outputs.
        """
class Scheduler:
    """
    Continuous-batching scheduler owning every sequence (C++), its KV block manager and its state slots. Step: schedule() -> inputs/model -> update(tokens) -> build_request_outputs / get_finished_seqs_info.
    """
    def __init__(self, num_blocks: typing.SupportsInt | typing.SupportsIndex, *, block_size: typing.SupportsInt | typing.SupportsIndex = 16, max_num_seqs: typing.SupportsInt | typing.SupportsIndex = 256, max_num_batched_tokens: typing.SupportsInt | typing.SupportsIndex = 8192, max_model_len: typing.SupportsInt | typing.SupportsIndex = 8192, vocab_size: typing.SupportsInt | typing.SupportsIndex, eos_token_id: typing.SupportsInt | typing.SupportsIndex | None = None, enable_chunked_prefill: bool = True, long_prefill_token_threshold: typing.SupportsInt | typing.SupportsIndex = 0, policy: str = 'fcfs', enable_prefix_caching: bool = True, watermark: typing.SupportsFloat | typing.SupportsIndex = 0.01, num_lookahead_slots: typing.SupportsInt | typing.SupportsIndex = 0, num_state_slots: typing.SupportsInt | typing.SupportsIndex = 0, hash_bits: typing.SupportsInt | typing.SupportsIndex = 64) -> None:
        """
        Create a scheduler. policy: 'fcfs' or 'priority' (smaller priority value first). long_prefill_token_threshold: per-sequence prefill tokens per step (0: no cap). watermark: fraction of blocks kept free when admitting. num_state_slots: recurrent-state slots (0: none; else >= max_num_seqs). hash_bits < 64 truncates prefix hashes (test hook: forces collisions). Raises ValueError naming a bad value, e.g. when the cache cannot hold one max_model_len sequence, or when the host bookkeeping of num_blocks (BlockManager tables) would need more than half of the physical memory or the address-space limit.
        """
    def abandon_step(self, action: str = 'recompute') -> list[str]:
        """
        Abandon the step in flight after a failure (an exception in the model, the sampler or the output step; between schedule() and update() / process_MTPInfo), ending it so that schedule() works again. Nothing of the step is applied: update_prompt_logprobs rows already given are kept (they are values, not KV). action='recompute': every sequence of the step goes back to the preempted queue (blocks and state slot freed, tokens kept; the blocks the step was to write were never registered in the prefix cache) and is computed again later. action='fail': every request with a sequence in the step is finished, all its sequences, with SequenceStatus.FINISHED_ERROR (finish_reason 'error'); get_finished_seqs_info and build_request_outputs report them now. In both modes the sequences that the step's blocks_to_copy / states_to_clone / states_to_zero write (fork children, copy-on-write, new slots) are recomputed and that device work is dropped: nothing of the step reaches a later one. With a step scheduled ahead (step_ahead), both steps in flight are abandoned together. Returns the request ids concerned (failed, or with a recomputed sequence), sorted; [] and no change when no step is in flight (safe in any except clause). Raises ValueError naming action for any other value.
        """
    def abort_request(self, request_ids: str | collections.abc.Sequence[str]) -> int:
        """
        Abort one request id (str) or several (iterable of str), at any point (waiting, mid-prefill, running, preempted, or while a step runs: its rows are then ignored by update). Returns how many were still unfinished. Raises ValueError for an unknown id (nothing is aborted then).
        """
    def add_request(self, request_id: str, prompt_token_ids: typing.Any, params: SamplingParams | None = None, *, arrival_time: float | None = None, output_kind: str = 'cumulative', priority: int = 0, eos_token_id: int | None = None, cache_salt: str | None = None) -> int:
        """
        Queue a request; returns the parent sequence's id. prompt_token_ids: list or integer array (loose). params: the request's SamplingParams (validated when it was built; None: the defaults); the scheduler keeps a copy and bounds its token ids and logprob counts by the vocabulary. arrival_time: time.time() value (None: now); output_kind 'cumulative' | 'delta' | 'final_only'; priority: smaller is scheduled first under the 'priority' policy (vLLM); eos_token_id: this request's EOS (None: the scheduler's); cache_salt: a secret string (vLLM's): the request reuses prefix-cached KV only of requests with the same salt, so tenants cannot probe each other's prompts by timing (None: the shared, unsalted cache). Raises ValueError naming the bad value (duplicate request id, token outside the vocabulary...), TypeError for a sampling keyword (they belong in SamplingParams); nothing is queued then.
        """
    def check_invariants(self) -> str:
        """
        Debug/test check of every block and slot invariant (O(blocks + tokens)); returns '' when consistent, else the first violation.
        """
    def get_sequence(self, seq_id: typing.SupportsInt | typing.SupportsIndex) -> Sequence:
        """
        The live sequence with this id. Raises ValueError if unknown or released.
        """
    def get_sequences(self, request_id: str) -> list[Sequence]:
        """
        The sequences of a request (parent first). Raises ValueError if unknown.
        """
    def get_stats(self) -> dict[str, typing.Any]:
        """
        dict: num_running, num_waiting, num_preempted, num_preemptions_total, num_unfinished_requests, kv_usage, prefix_cache_hit_rate, prefix_cache_queries, prefix_cache_hits, num_free_blocks, num_cached_blocks, num_evictions, num_cow_copies.
        """
    def has_unfinished_requests(self) -> bool:
        """
        Whether any request is not finished.
        """
    def reset_prefix_cache(self) -> bool:
        """
        Forget every cached block (e.g. after new weights). Returns True.
        """
    def schedule(self, overlap: bool = False) -> SchedulerOutputs | None:
        """
        Schedule the next step (releases the GIL). Returns the scheduler's SchedulerOutputs (rewritten by the next call). Raises ValueError if the previous step has not been updated.
        
        overlap=True (ZOS): schedule step N+1 while step N is in flight, before its tokens are known, assuming one new token per sequence of step N (the ZOS builders then take each row's input token from step N's sampled tokens on the device). Returns None, changing nothing, when step N+1 cannot run ahead: step N is not plain decodes (prefill chunks, drafts, n > 1 samples, block copies), a request waits or a preempted one would resume, a sequence needs a copy-on-write or blocks that are not free (preemption), or every sequence surely finishes at step N; then update step N and schedule synchronously. Sequences that surely finish at step N (max_tokens, max_model_len) are left out of step N+1. While a step runs ahead (step_ahead), update() applies step N, and a sequence that finishes there (EOS, stop token, stop_sequence, abort) keeps its step N+1 row, whose token update() then ignores. ValueError when no step is in flight or a step already runs ahead.
        """
    def stop_sequence(self, seq_id: typing.SupportsInt | typing.SupportsIndex, stop_string: str, num_output_tokens: typing.SupportsInt | typing.SupportsIndex, output: typing.Any = None) -> None:
        """
        Finish a sequence for a stop string found by the detokenizer, keeping its first num_output_tokens output tokens (stop_reason = stop_string, finish_reason 'stop'); a sequence that already finished in this step (e.g. at max_tokens) becomes 'stop'. output: the RequestOutput of the sequence's request from the last build_request_outputs, or None. Given, it is corrected in place (the completion's tokens cut at the stop, its finish and stop reason, `finished` once every sample ended) and the request is not reported again: its outputs are built once. Without it the next build_request_outputs reports the request again. Raises ValueError for an unknown seq_id, a count outside [0, output length] or another request's output; TypeError for an output that is not a RequestOutput.
        """
    def update(self, sampled_token_ids: typing.Any, logprobs: typing.Any = None, topk_token_ids: typing.Any = None, topk_logprobs: typing.Any = None) -> None:
        """
        Apply the step's sampled tokens (releases the GIL). sampled_token_ids: num_sample_rows token ids, any 1-D integer array — an int32 C-contiguous numpy array is read in place (borrowed), another integer dtype or layout, a CPU tensor (DLPack) or a list is converted once; a non-integer dtype is a TypeError, a wrong length or an id outside the vocabulary a ValueError. Borrowed, read-only: logprobs float32[num_sample_rows] (sampled tokens' logprobs) or None; topk_token_ids int32[num_sample_rows, k] with topk_logprobs float32[num_sample_rows, k], or None. Advances computed tokens, registers full blocks in the prefix cache, forks n > 1 groups, appends tokens and applies stop conditions. Validates everything first (token ids and the top-k ids a row reports in the vocabulary, shapes): on error nothing changes. A step with draft rows (speculative decoding) is refused with ValueError: apply it with process_MTPInfo.
        """
    @property
    def block_manager(self) -> BlockManager:
        """
        Its BlockManager.
        """
    @property
    def max_model_len(self) -> int:
        """
        Max tokens per sequence.
        """
    @property
    def num_preempted(self) -> int:
        """
        Preempted sequences waiting to resume.
        """
    @property
    def num_running(self) -> int:
        """
        Running sequences.
        """
    @property
    def num_unfinished_requests(self) -> int:
        """
        Requests not finished.
        """
    @property
    def num_waiting(self) -> int:
        """
        Waiting (never scheduled) sequences.
        """
    @property
    def running_seq_ids(self) -> numpy.typing.NDArray[numpy.int64]:
        """
        int64: running sequences in scheduling order.
        """
    @property
    def step_ahead(self) -> bool:
        """
        True while a step scheduled with schedule(overlap=True) runs ahead of the step before it, whose update() is still due (two steps in flight).
        """
    @property
    def step_in_flight(self) -> bool:
        """
        True between schedule() and update() (with a step scheduled ahead: until the update of the newer step).
        """
    @property
    def vocab_size(self) -> int:
        """
        Vocabulary size.
        """
    @property
    def waiting_seq_ids(self) -> numpy.typing.NDArray[numpy.int64]:
        """
        int64: preempted and waiting sequences, in admission order (by priority under the 'priority' policy, preempted ones first on ties; then arrival_time and add order).
        """
class RequestOutput:
    """
    Output of one request after a step (from build_request_outputs; pooled). Fields are read on access; ``completion.text`` is written by the detokenizer.
    """
    class Completion:
        """
        One sample of a RequestOutput (vLLM's CompletionOutput).
        """
        @property
        def cumulative_logprob(self) -> float | None:
            """
            Sum of the sampled tokens' logprobs; None when logprobs were not requested.
            """
        @property
        def finish_reason(self) -> typing.Any:
            """
            'stop', 'length', 'abort', 'ignored', 'error' or None.
            """
        @property
        def finished(self) -> bool:
            """
            Whether this sample finished.
            """
        @property
        def index(self) -> int:
            """
            Sample index in the request (0..n-1).
            """
        @property
        def logprobs(self) -> typing.Any:
            """
            None when not requested; else per token {token_id: logprob}, sampled token first.
            """
        @property
        def stop_reason(self) -> typing.Any:
            """
            Stop token id, stop string (or the ignore reason), or None.
            """
        @property
        def text(self) -> str:
            """
            Text, written by the Python detokenizer ('' until then).
            """
        @text.setter
        def text(self, arg0: str) -> None:
            ...
        @property
        def token_ids(self) -> list:
            """
            list[int]: generated tokens (all, or new ones in delta kind).
            """
    def __repr__(self) -> str:
        ...
    @property
    def finished(self) -> bool:
        """
        Whether every sample finished.
        """
    @property
    def metrics(self) -> dict[str, typing.Any]:
        """
        dict: arrival_time, first_scheduled_time, first_token_time, finished_time (time.time() seconds or None), num_cached_tokens (prefix-cache hit tokens).
        """
    @property
    def outputs(self) -> list[RequestOutput.Completion]:
        """
        list[RequestOutput.Completion]: one per sample in this output (delta kind: those with new tokens).
        """
    @property
    def prompt_logprobs(self) -> typing.Any:
        """
        None when not requested; else a list over the prompt positions covered (None for position 0, then {token_id: logprob} with the prompt token first).
        """
    @property
    def prompt_token_ids(self) -> list:
        """
        list[int]: the prompt.
        """
    @property
    def request_id(self) -> str:
        """
        The request id.
        """
class RequestOutputPool:
    """
    Recycles RequestOutput objects: one is reused by build_request_outputs once nothing outside the pool references it.
    """
    def __init__(self, max_size: typing.SupportsInt | typing.SupportsIndex = 4096) -> None:
        """
        A pool keeping at most max_size objects.
        """
    def __len__(self) -> int:
        """
        Objects held.
        """
    def add_columnar(self, request_id: str, slot: typing.SupportsInt | typing.SupportsIndex) -> None:
        """
        Register a request whose plain deltas build_request_outputs writes as rows of columns (read with take_columns) instead of RequestOutput objects: each output of the 'delta' kind with one sample (n == 1), no logprobs and no prompt logprobs, after the request's first output and not finished, becomes a row (slot, its new tokens, possibly none). Its other outputs (the first, the finished one, an abort) are RequestOutputs as before; building its finished output unregisters it. slot: the caller's number for the request (rows name it). ValueError for a slot outside [0, 2**31 - 1] or a request registered already.
        """
    def discard_columnar(self, request_id: str) -> bool:
        """
        Unregister a request (e.g. released); False when it was not registered.
        """
    def take_columns(self) -> tuple[numpy.typing.NDArray[numpy.int32], numpy.typing.NDArray[numpy.int64], numpy.typing.NDArray[numpy.int32]]:
        """
        The rows build_request_outputs wrote since the last call, in build order, as three new arrays: (slots int32[R], offsets int64[R + 1], token_ids int32[T]); row r's new tokens are token_ids[offsets[r]:offsets[r + 1]] (offsets[0] == 0, offsets[R] == T). The rows are cleared.
        """
    @property
    def max_size(self) -> int:
        """
        Most objects kept.
        """
    @property
    def num_columnar(self) -> int:
        """
        Requests registered with add_columnar.
        """
class FlopsEstimator:
    """
    Analytic FLOPs of a model step from the model's dimensions, for MFU reporting.
    
    A multiply-add counts as 2 FLOPs. Per token: the attention projections (q, k, v, o with
    grouped-query K/V widths), the MLP (dense SwiGLU: gate, up, down; MoE layers: top-k routed
    plus shared experts of ``moe_intermediate_size`` and the router), and attention
    ``4 * num_attention_heads * head_dim`` FLOPs per (layer, attended token) over the token's
    causal context, capped at ``sliding_window`` on sliding layers. Per logits row: the LM head
    ``2 * hidden_size * vocab_size``. Invalid dimensions raise ValueError naming the field.
    """
    def __init__(self, *, hidden_size: typing.SupportsInt | typing.SupportsIndex, num_layers: typing.SupportsInt | typing.SupportsIndex, num_attention_heads: typing.SupportsInt | typing.SupportsIndex, num_kv_heads: typing.SupportsInt | typing.SupportsIndex = 0, head_dim: typing.SupportsInt | typing.SupportsIndex = 0, intermediate_size: typing.SupportsInt | typing.SupportsIndex, vocab_size: typing.SupportsInt | typing.SupportsIndex, num_experts: typing.SupportsInt | typing.SupportsIndex = 0, num_experts_per_tok: typing.SupportsInt | typing.SupportsIndex = 0, moe_intermediate_size: typing.SupportsInt | typing.SupportsIndex = 0, num_shared_experts: typing.SupportsInt | typing.SupportsIndex = 0, first_k_dense_layers: typing.SupportsInt | typing.SupportsIndex = 0, sliding_window: typing.SupportsInt | typing.SupportsIndex = 0, sliding_layers: collections.abc.Sequence[bool] | None = None) -> None:
        """
        Build from model dimensions. num_kv_heads=0 means num_attention_heads; head_dim=0 means hidden_size // num_attention_heads; num_experts=0 means a dense MLP on every layer; sliding_window=0 means full attention; sliding_layers (one bool per layer) picks the sliding layers, None means all of them when sliding_window > 0.
        """
    def attention_flops(self, context_len: typing.SupportsInt | typing.SupportsIndex) -> int:
        """
        Attention FLOPs (all layers) of one token that attends to context_len tokens.
        """
    def chunk_attention_flops(self, query_len: typing.SupportsInt | typing.SupportsIndex, context_len: typing.SupportsInt | typing.SupportsIndex) -> int:
        """
        Attention FLOPs of a causal chunk of query_len tokens ending at context_len (token j of the chunk sees context_len - query_len + j + 1 tokens).
        """
    def step_flops(self, query_lens: typing.Any, context_lens: typing.Any, num_logits: typing.SupportsInt | typing.SupportsIndex) -> int:
        """
        FLOPs of a whole step. query_lens / context_lens: per sequence, tokens computed this step and the context length after the step (list or integer array); num_logits: LM-head rows.
        """
    @property
    def linear_flops_per_token(self) -> int:
        """
        FLOPs of the linear layers (all layers, no LM head) for one token.
        """
    @property
    def lm_head_flops_per_row(self) -> int:
        """
        FLOPs of the LM head for one logits row: 2 * hidden_size * vocab_size.
        """
class YocoPrefillTruncationMode:
    """
    Prefill truncation for decoder-decoder (YOCO-style) models whose upper layers write no KV:
    which flattened rows continue past the self-decoder. The builders write the kept rows to
    ``PrepareArgs.yoco_kept_rows`` and their per-sequence offsets to ``yoco_cu_seqlens``.
    
    Members:
    
      NONE : Every row runs every layer; no kept-row output.
    
      LAST_TOKEN : Only each sequence's final row of the step.
    
      LOGITS_ROWS : Every row whose logits are needed: sampled rows, prompt-logprob rows, speculative rows.
    """
    LAST_TOKEN: typing.ClassVar[YocoPrefillTruncationMode]
    LOGITS_ROWS: typing.ClassVar[YocoPrefillTruncationMode]
    NONE: typing.ClassVar[YocoPrefillTruncationMode]
    __members__: typing.ClassVar[dict[str, YocoPrefillTruncationMode]]
    @typing.overload
    def __eq__(self, other: YocoPrefillTruncationMode) -> bool:
        ...
    @typing.overload
    def __eq__(self, other: typing.Any) -> bool:
        ...
    def __getstate__(self) -> int:
        ...
    def __hash__(self) -> int:
        ...
    def __index__(self) -> int:
        ...
    def __init__(self, value: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def __int__(self) -> int:
        ...
    @typing.overload
    def __ne__(self, other: YocoPrefillTruncationMode) -> bool:
        ...
    @typing.overload
    def __ne__(self, other: typing.Any) -> bool:
        ...
    def __repr__(self) -> str:
        ...
    def __setstate__(self, state: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def __str__(self) -> str:
        ...
    @property
    def name(self) -> str:
        ...
    @property
    def value(self) -> int:
        ...
class SequenceMetadata:
    """
    The per-step view of one scheduled sequence, as read from a SequenceMetadataPool
    (``pool[i]``): a snapshot (copies), for inspection and tests; the builders read the pool
    directly, so the hot path creates no SequenceMetadata objects.
    """
    def __repr__(self) -> str:
        ...
    @property
    def block_table(self) -> list[int]:
        """
        The sequence's KV block ids.
        """
    @property
    def context_len(self) -> int:
        """
        num_computed_tokens + num_new_tokens.
        """
    @property
    def do_sample(self) -> bool:
        """
        True when the step samples a token for it (last prompt chunk or decode).
        """
    @property
    def is_prompt(self) -> bool:
        """
        True for a prefill chunk.
        """
    @property
    def num_computed_tokens(self) -> int:
        """
        Tokens already in the KV cache before this step (first position computed).
        """
    @property
    def num_drafts(self) -> int:
        """
        Draft tokens verified this step.
        """
    @property
    def num_new_tokens(self) -> int:
        """
        Query length of this step (chunk size, or 1 + drafts).
        """
    @property
    def num_prompt_tokens(self) -> int:
        """
        Prompt length.
        """
    @property
    def prompt_logprobs(self) -> int:
        """
        Prompt logprobs requested (top-k), -1 when none.
        """
    @property
    def request_id(self) -> str:
        """
        Request id.
        """
    @property
    def seq_id(self) -> int:
        """
        Sequence id.
        """
    @property
    def state_slot(self) -> int:
        """
        Recurrent-state slot, -1 when none.
        """
class SequenceMetadataPool:
    """
    The scheduled sequences of one step, in batch-row order, reused step after step (no
    allocation in the steady state). Fill it from a SchedulerOutputs (``build``) or row by row
    with ``add_sequence`` (standalone sequences owned by the pool until ``clear``). The builders
    (prepare_prompt_v4, ...) and prepare_sampler_inputs read it.
    """
    def __getitem__(self, index: typing.SupportsInt | typing.SupportsIndex) -> SequenceMetadata:
        """
        Snapshot of row `index` as a SequenceMetadata.
        """
    def __init__(self) -> None:
        """
        An empty pool.
        """
    def __len__(self) -> int:
        """
        Number of rows.
        """
    def add_sequence(self, *, seq_id: typing.SupportsInt | typing.SupportsIndex, request_id: str, token_ids: typing.Any, num_prompt_tokens: typing.SupportsInt | typing.SupportsIndex, num_computed_tokens: typing.SupportsInt | typing.SupportsIndex, num_new_tokens: typing.SupportsInt | typing.SupportsIndex, block_table: typing.Any, draft_tokens: typing.Any = None, state_slot: typing.SupportsInt | typing.SupportsIndex = -1, is_prompt: bool | None = None, params: SamplingParams | None = None, eos_token_id: typing.SupportsInt | typing.SupportsIndex = -1) -> None:
        """
        Append a standalone row (a sequence the pool owns until clear()): for runtimes without a
        Scheduler and for tests. token_ids: prompt + outputs so far (loose: list or int array);
        the step computes positions [num_computed_tokens, num_computed_tokens + num_new_tokens),
        positions past the known tokens are draft_tokens (a speculative decode row). is_prompt
        defaults to num_computed_tokens < len(token_ids) - 1. params: the request's SamplingParams
        (None: the defaults; its max_tokens is ignored, the pool never stops a row); eos_token_id:
        the request's EOS (-1: none), masked below min_tokens. Raises ValueError/TypeError naming the
        argument; the pool is unchanged on error.
        """
    def build(self, scheduler: Scheduler) -> int:
        """
        Replace the rows with the sequences of the scheduler's last schedule() (decodes first, then prefill chunks), without copying their tokens: rows refer to the scheduler's sequences by slot. Returns the row count. Build after every schedule(): the builders refuse (ValueError naming this call) rows built for another step of the scheduler, or once it has no step in flight.
        """
    def clear(self) -> None:
        """
        Forget every row (storage is kept for reuse).
        """
class PrepareArgs:
    """
    Static configuration of input preparation plus the persistent borrowed output buffers the
    builders write (numpy arrays, typically ``tensor.numpy()`` views of pinned torch tensors;
    never copied). Capacities: ``max_num_tokens = len(input_ids)``, ``max_num_seqs =
    block_tables.shape[0]``, ``max_blocks_per_seq = block_tables.shape[1]``. Every buffer is
    validated here (dtype, 1-D/2-D, C-contiguous, writable, capacity) — TypeError/ValueError
    naming the argument. block_tables is zero-filled once here and then rewritten only where a
    row changed. After each builder call the read-only counters (num_tokens, num_seqs,
    num_rows, num_logits, num_yoco_rows) describe the step.
    """
    def __init__(self, *, block_size: typing.SupportsInt | typing.SupportsIndex, max_model_len: typing.SupportsInt | typing.SupportsIndex, input_ids: typing.Any, positions: typing.Any, slot_mapping: typing.Any, query_start_loc: typing.Any, seq_lens: typing.Any, block_tables: typing.Any, logits_indices: typing.Any, graph_batch_sizes: typing.Any = None, yoco_mode: YocoPrefillTruncationMode = ..., yoco_kept_rows: typing.Any = None, yoco_cu_seqlens: typing.Any = None, engram_ngram_orders: typing.Any = None, engram_heads_per_order: typing.SupportsInt | typing.SupportsIndex = 1, engram_layer_seeds: typing.Any = None, engram_table_sizes: typing.Any = None, engram_indices: typing.Any = None, zos_source_index: typing.Any = None) -> None:
        """
        Borrowed buffers (all C-contiguous, writable):
        input_ids int32 (T,); positions int32 (>= T,); slot_mapping int64 (>= T,);
        query_start_loc int32 (>= S + 1,); seq_lens int32 (>= S,); block_tables int32 (S, W);
        logits_indices int32 (>= T,); yoco_kept_rows int32 (>= T,) and yoco_cu_seqlens int32
        (>= S + 1,) when yoco_mode is not NONE; engram_indices int32 (>= T, C) with
        C = len(engram_layer_seeds) * len(engram_ngram_orders) * engram_heads_per_order when Engram
        is on; zos_source_index int32 (>= T,) for the ZOS builders. graph_batch_sizes: decode batch
        sizes to pad to (each <= S; loose list). Engram: n-gram orders (each 1..16), heads per
        order, one hash seed per Engram layer, one table size per order (1..2^31-1).
        """
    def zos_discard(self, finished_seq_ids: typing.Any) -> tuple[numpy.typing.NDArray[numpy.int32], numpy.typing.NDArray[numpy.int32]]:
        """
        ZOS: after step N's update, turn the rows of the last prepared step that belong to
        sequences finished at step N into placeholders: their slot_mapping entries become -1 (no KV
        write into freed blocks) and their logits rows stop sampling. Returns (batch_rows,
        logits_rows) int32 arrays of the discarded rows; the runtime ignores outputs of those rows.
        """
    @property
    def block_size(self) -> int:
        """
        Tokens per KV block.
        """
    @property
    def engram_num_columns(self) -> int:
        """
        Columns of engram_indices (0 when Engram is off).
        """
    @property
    def graph_batch_sizes(self) -> list[int]:
        """
        Sorted decode graph batch sizes.
        """
    @property
    def max_blocks_per_seq(self) -> int:
        """
        Block-table width.
        """
    @property
    def max_model_len(self) -> int:
        """
        Longest context a row may reach.
        """
    @property
    def max_num_seqs(self) -> int:
        """
        Batch-row capacity (block_tables rows).
        """
    @property
    def max_num_tokens(self) -> int:
        """
        Token-row capacity (len(input_ids)).
        """
    @property
    def num_block_rows_written(self) -> int:
        """
        Block-table rows (re)written since construction (incremental-update statistics).
        """
    @property
    def num_logits(self) -> int:
        """
        Logits rows of the last step (entries of logits_indices).
        """
    @property
    def num_rows(self) -> int:
        """
        Batch rows of the last step, padding rows included.
        """
    @property
    def num_seqs(self) -> int:
        """
        Real (non-placeholder) batch rows of the last step.
        """
    @property
    def num_tokens(self) -> int:
        """
        Flattened token rows of the last step (padding included).
        """
    @property
    def num_yoco_rows(self) -> int:
        """
        Kept rows of the last step (YOCO modes other than NONE).
        """
    @property
    def row_seq_ids(self) -> numpy.ndarray:
        """
        Per batch row of the last step: its seq_id, -1 for placeholder or discarded rows (a read-only view, valid until the next prepare or zos_discard with these args).
        """
    @property
    def yoco_mode(self) -> YocoPrefillTruncationMode:
        """
        YOCO prefill truncation mode.
        """
class SamplingKernelInputs:
    """
    Per sample row parameters of the sampling kernel (read-only numpy views of engine-owned memory,
    valid until the next prepare_sampler_inputs with the same SamplerInputs). Same seed and offset give the same token whatever the batch:
    ``seeds`` is the request's seed (or a fixed function of the engine's generator seed and the
    sequence id), ``offsets`` the index of the output token being sampled, ``subsequences`` the
    sample index within an n > 1 request.
    """
    @property
    def all_greedy(self) -> bool:
        """
        Every real row is greedy (skip random sampling).
        """
    @property
    def all_random(self) -> bool:
        """
        No real row is greedy.
        """
    @property
    def logits_rows(self) -> numpy.ndarray:
        """
        int32: logits row sampled by each sample row.
        """
    @property
    def min_p(self) -> numpy.ndarray:
        """
        float32: 0 = off.
        """
    @property
    def no_min_p(self) -> bool:
        """
        No random row uses min-p.
        """
    @property
    def no_top_k(self) -> bool:
        """
        No random row uses top-k.
        """
    @property
    def no_top_p(self) -> bool:
        """
        No random row uses top-p.
        """
    @property
    def num_rows(self) -> int:
        """
        Sample rows (placeholders included).
        """
    @property
    def offsets(self) -> numpy.ndarray:
        """
        int64: RNG offset = index of the output token sampled.
        """
    @property
    def seeds(self) -> numpy.ndarray:
        """
        int64: RNG seed of the row's request.
        """
    @property
    def subsequences(self) -> numpy.ndarray:
        """
        int32: RNG subsequence = sample index in the request.
        """
    @property
    def temperature(self) -> numpy.ndarray:
        """
        float32: 0 = greedy.
        """
    @property
    def top_k(self) -> numpy.ndarray:
        """
        int32: -1 = off.
        """
    @property
    def top_p(self) -> numpy.ndarray:
        """
        float32: 1 = off.
        """
class LogitsTransformInputs:
    """
    Logits transforms per sample row, sparse (CSR: ``*_offsets`` has num_rows + 1 entries; row r
    owns ``[offsets[r], offsets[r + 1])`` of the value arrays). Penalties (vLLM semantics):
    presence and frequency apply to tokens counted in the output, repetition to tokens in the
    prompt or the output. Their token counts come in one of two forms, by the SamplerInputs'
    ``penalty_counts`` mode:
    
    * "full": ``penalty_token_ids`` lists each distinct token of the row's sequence once with its
      output count and an in-prompt flag, every step; ``penalty_slots`` is all -1 and there are no
      updates (``num_penalty_updates`` = 0, ``num_penalty_slots`` = 0).
    * "incremental": the consumer keeps one table per slot (output count and in-prompt flag per
      token of the vocabulary); ``penalty_slots`` gives each row's slot and ``penalty_update_*``
      what changed in the tables this step, which the consumer applies in order before reading them
      (CSR over ``num_penalty_updates`` slots: zero the slot when ``penalty_update_reset``, then for
      each entry add 1 to the token's output count when ``penalty_update_is_output``, else mark it
      as in the prompt; duplicates accumulate). ``penalty_offsets`` is all 0 and the full lists are
      empty. Every call's updates must be applied, in call order (see
      SamplerInputs.reset_penalty_tables).
    
    ``penalty_pending_source`` (ZOS, both modes) is counted by the device for this step only: it
    is never in the tables or the full lists yet (the host sends it once it knows the token).
    ``banned_*``: tokens set to -inf (banned ids, plus EOS and stop ids while the row is below
    min_tokens). ``allowed_*``: when a row's range is not empty, every other token is set to -inf.
    """
    @property
    def allowed_offsets(self) -> numpy.ndarray:
        """
        int32 CSR offsets of allowed tokens.
        """
    @property
    def allowed_token_ids(self) -> numpy.ndarray:
        """
        int32, sorted per row.
        """
    @property
    def banned_offsets(self) -> numpy.ndarray:
        """
        int32 CSR offsets of masked tokens.
        """
    @property
    def banned_token_ids(self) -> numpy.ndarray:
        """
        int32, sorted per row.
        """
    @property
    def bias_offsets(self) -> numpy.ndarray:
        """
        int32 CSR offsets of the logit bias.
        """
    @property
    def bias_token_ids(self) -> numpy.ndarray:
        """
        int32.
        """
    @property
    def bias_values(self) -> numpy.ndarray:
        """
        float32 added to the logits.
        """
    @property
    def frequency_penalty(self) -> numpy.ndarray:
        """
        float32 per row.
        """
    @property
    def no_allowed(self) -> bool:
        """
        No row restricts to allowed tokens.
        """
    @property
    def no_banned(self) -> bool:
        """
        No row masks tokens.
        """
    @property
    def no_logit_bias(self) -> bool:
        """
        No row has a logit bias.
        """
    @property
    def no_penalties(self) -> bool:
        """
        No row has a penalty.
        """
    @property
    def num_penalty_slots(self) -> int:
        """
        Slot ids in use are below this (the consumer grows its tables to it; 0 in "full" mode). It never decreases, except after SamplerInputs.reset_penalty_tables().
        """
    @property
    def num_penalty_updates(self) -> int:
        """
        Slots updated this step (U; 0 in "full" mode).
        """
    @property
    def num_rows(self) -> int:
        """
        Sample rows.
        """
    @property
    def penalty_in_prompt(self) -> numpy.ndarray:
        """
        uint8 1 if the token occurs in the prompt ("full" mode; empty in "incremental" mode).
        """
    @property
    def penalty_offsets(self) -> numpy.ndarray:
        """
        int32 CSR offsets of the full penalty token lists ("full" mode; all 0 in "incremental" mode).
        """
    @property
    def penalty_output_counts(self) -> numpy.ndarray:
        """
        int32 occurrences in the output ("full" mode; empty in "incremental" mode).
        """
    @property
    def penalty_pending_source(self) -> numpy.ndarray:
        """
        int32 ZOS: logits row of the previous step whose sampled token is also an output token of this row (add it to the counts on the device for this step only: it is not in the tables, a later step's update sends it); -1 none.
        """
    @property
    def penalty_slots(self) -> numpy.ndarray:
        """
        int32 per row: the slot whose table holds the counts of the row's sequence ("incremental" mode; rows of one n > 1 prompt share it); -1 for rows without penalties, placeholders and "full" mode.
        """
    @property
    def penalty_token_ids(self) -> numpy.ndarray:
        """
        int32 distinct token ids ("full" mode; empty in "incremental" mode).
        """
    @property
    def penalty_update_is_output(self) -> numpy.ndarray:
        """
        uint8: 1 = add 1 to the token's output count, 0 = mark the token as in the prompt.
        """
    @property
    def penalty_update_offsets(self) -> numpy.ndarray:
        """
        int32 [U + 1]: CSR offsets of each update's entries.
        """
    @property
    def penalty_update_reset(self) -> numpy.ndarray:
        """
        uint8 [U]: 1 = zero the slot's table before applying its entries (a new or reused slot, or a sequence that shrank / changed its prompt length: its entries list the whole sequence).
        """
    @property
    def penalty_update_slots(self) -> numpy.ndarray:
        """
        int32 [U]: the slot of each update.
        """
    @property
    def penalty_update_token_ids(self) -> numpy.ndarray:
        """
        int32: raw tokens appended to the sequence since the slot was last sent (in order, duplicates possible: accumulate).
        """
    @property
    def presence_penalty(self) -> numpy.ndarray:
        """
        float32 per row.
        """
    @property
    def repetition_penalty(self) -> numpy.ndarray:
        """
        float32 per row (1 = off).
        """
class PrefillSamplingInputs:
    """
    Sample rows of sequences completing their prompt this step.
    """
    @property
    def num_rows(self) -> int:
        """
        Number of prefill sample rows.
        """
    @property
    def sample_rows(self) -> numpy.ndarray:
        """
        int32 sample-row indices.
        """
class DecodeSamplingInputs:
    """
    Sample rows of decode sequences, followed by the placeholder rows that pad a decode-only step to its graph batch size.
    """
    @property
    def num_real_rows(self) -> int:
        """
        Decode sample rows without padding.
        """
    @property
    def num_rows(self) -> int:
        """
        Decode sample rows, padding included.
        """
    @property
    def sample_rows(self) -> numpy.ndarray:
        """
        int32 sample-row indices.
        """
class DriverSamplingInputs:
    """
    What the driver needs to read results back: per sample row its sequence and logprobs request. Pass tokens[:num_real_rows] to Scheduler.update (placeholder rows are last).
    """
    @property
    def batch_rows(self) -> numpy.ndarray:
        """
        int32 batch row of each sample row.
        """
    @property
    def max_num_logprobs(self) -> int:
        """
        Largest top-k of logprobs requested, -1 none.
        """
    @property
    def num_logprobs(self) -> numpy.ndarray:
        """
        int32 logprobs requested, -1 none.
        """
    @property
    def num_real_rows(self) -> int:
        """
        Sample rows of real sequences.
        """
    @property
    def num_rows(self) -> int:
        """
        Sample rows.
        """
    @property
    def seq_ids(self) -> numpy.ndarray:
        """
        int64 seq_id, -1 for placeholders.
        """
class SpeculativeSamplingInputs:
    """
    Rejection-sampling inputs of speculative decode rows: per sequence its drafts (CSR by cu_num_drafts), the logits row verifying each draft and the bonus-token logits row.
    """
    @property
    def bonus_logits_rows(self) -> numpy.ndarray:
        """
        int32 logits row of the bonus token.
        """
    @property
    def cu_num_drafts(self) -> numpy.ndarray:
        """
        int32 offsets into draft_token_ids.
        """
    @property
    def draft_token_ids(self) -> numpy.ndarray:
        """
        int32 draft tokens.
        """
    @property
    def num_drafts(self) -> numpy.ndarray:
        """
        int32 drafts per sequence.
        """
    @property
    def num_drafts_total(self) -> int:
        """
        Draft tokens in all.
        """
    @property
    def num_seqs(self) -> int:
        """
        Speculative sequences.
        """
    @property
    def sample_rows(self) -> numpy.ndarray:
        """
        int32 sample row of each sequence.
        """
    @property
    def target_logits_rows(self) -> numpy.ndarray:
        """
        int32 logits row that verifies each draft.
        """
class PromptLogprobInputs:
    """
    Logits rows that give prompt logprobs: row k's log-softmax scores the prompt token at positions[k] (target_token_ids[k]).
    """
    @property
    def batch_rows(self) -> numpy.ndarray:
        """
        int32 batch row.
        """
    @property
    def logits_rows(self) -> numpy.ndarray:
        """
        int32 logits rows.
        """
    @property
    def max_num_logprobs(self) -> int:
        """
        Largest top-k requested, -1 none.
        """
    @property
    def num_logprobs(self) -> numpy.ndarray:
        """
        int32 top-k requested.
        """
    @property
    def num_rows(self) -> int:
        """
        Prompt-logprob rows.
        """
    @property
    def positions(self) -> numpy.ndarray:
        """
        int32 its prompt position (1..P-1).
        """
    @property
    def seq_ids(self) -> numpy.ndarray:
        """
        int64 sequence id.
        """
    @property
    def target_token_ids(self) -> numpy.ndarray:
        """
        int32 prompt token scored.
        """
class SamplerInputs:
    """
    Everything the sampler needs for one step; reused step after step (engine-owned numpy
    storage that grows when needed). Its arrays are read-only views, valid until the next
    prepare_sampler_inputs with this object: that call rewrites them (copy what must outlive it);
    they never dangle. Filled by prepare_sampler_inputs.
    """
    def __init__(self, generator_seed: typing.SupportsInt | typing.SupportsIndex = 0, *, penalty_counts: str = 'incremental') -> None:
        """
        generator_seed: derives the RNG seed of requests without a seed (fixed per sequence).
        penalty_counts: how penalty token counts reach the consumer (see LogitsTransformInputs):
        "incremental" (default) sends each step only the tokens appended since the last call, for tables
        the consumer keeps per slot; "full" sends every penalized sequence's distinct tokens with their
        counts each step (stateless consumer, slower). ValueError for any other value.
        In "incremental" mode one SamplerInputs feeds one consumer, which must apply every call's updates
        in call order; skipping one desynchronises the tables (reset_penalty_tables() recovers).
        """
    def reset_penalty_tables(self) -> None:
        """
        Forget every penalty slot: the next prepare_sampler_inputs sends each penalized sequence whole, with reset = 1, in slots numbered from 0 again. For a consumer that lost or reallocated its tables (or missed a call). Harmless in "full" mode.
        """
    @property
    def decode(self) -> DecodeSamplingInputs:
        """
        DecodeSamplingInputs.
        """
    @property
    def driver(self) -> DriverSamplingInputs:
        """
        DriverSamplingInputs.
        """
    @property
    def generator_seed(self) -> int:
        """
        Seed source of unseeded requests.
        """
    @property
    def kernel(self) -> SamplingKernelInputs:
        """
        SamplingKernelInputs.
        """
    @property
    def num_calls(self) -> int:
        """
        prepare_sampler_inputs calls that filled this object so far (rejected calls not counted): a consumer of incremental penalty updates checks it grows by exactly 1 between the calls it applies.
        """
    @property
    def penalty_counts(self) -> str:
        """
        "incremental" or "full" (set at construction).
        """
    @property
    def prefill(self) -> PrefillSamplingInputs:
        """
        PrefillSamplingInputs.
        """
    @property
    def prompt_logprobs(self) -> PromptLogprobInputs:
        """
        PromptLogprobInputs.
        """
    @property
    def speculative(self) -> SpeculativeSamplingInputs:
        """
        SpeculativeSamplingInputs.
        """
    @property
    def transform(self) -> LogitsTransformInputs:
        """
        LogitsTransformInputs.
        """
def build_request_outputs(scheduler: Scheduler, pool: RequestOutputPool) -> list[RequestOutput]:
    """
    RequestOutputs of the requests updated since the previous call (or schedule()): new tokens, finishes, aborts, stop strings; per each request's output_kind (cumulative / delta / final_only). Objects come from pool; the plain deltas of the requests registered with pool.add_columnar are rows of pool.take_columns instead. Holds the GIL (creates Python objects).
    """
def clone_and_zero_states_and_blocks(scheduler: Scheduler, seq_id: typing.SupportsInt | typing.SupportsIndex, num_children: typing.SupportsInt | typing.SupportsIndex) -> tuple[numpy.typing.NDArray[numpy.int64], numpy.typing.NDArray[numpy.int32], numpy.typing.NDArray[numpy.int32], numpy.typing.NDArray[numpy.int32]]:
    """
    Fork a running sequence into num_children new sequences of its request: they share its full KV blocks (ref counts), get a copy of its partial last block (shared + copy-on-write when no block is free) and a clone of its state slot (a zeroed slot if it has no computed state). Returns (child seq ids int64[k], blocks_to_copy int32[m, 2], states_to_clone int32[c, 2], states_to_zero int32[z]) for the device to apply before the next forward. Scheduler.update calls the same C++ code after an n > 1 prompt. Raises ValueError for an unknown/non-running seq_id or no room for the children.
    """
def encode_compressed(token_ids: typing.Any, out: typing.Any = None) -> numpy.ndarray:
    """
    Map token ids to Engram compressed ids through the installed lookup table.
    
    token_ids: list or 1-D integer array. out: optional borrowed int32 C-contiguous writable
    buffer with at least ``len(token_ids)`` elements (written in place and returned); without it a
    new int32 array is returned. Releases the GIL while mapping. Raises ValueError when no table is
    installed or an id is outside the vocabulary (naming the index and value), TypeError for
    non-integer input; nothing is written on error.
    """
def get_finished_seqs_info(scheduler: Scheduler) -> dict[str, typing.Any]:
    """
    Sequences finished since the last schedule() (update, aborts, stop strings, ignored prompts): dict of seq_ids int64[k], request_ids list[str], statuses int32[k] (SequenceStatus values), num_prompt_tokens int32[k], num_output_tokens int32[k], sample_indices int32[k].
    """
def prepare_decode_v4(args: PrepareArgs, metadata: SequenceMetadataPool) -> int:
    """
    Build the model inputs of a decode-only step (each row: its last token, plus drafts for speculative rows), padded to the next graph batch size with placeholder rows (max query length tokens each, input 0, position 0, slot -1, seq_len = that length, zero block-table row, all their tokens logits rows).
    
    args: the PrepareArgs whose buffers are written; metadata: the step's SequenceMetadataPool.
    Writes input_ids, positions, slot_mapping (block_table[p // block_size] * block_size +
    p % block_size), query_start_loc, seq_lens, block-table rows that changed, logits_indices,
    and the YOCO / Engram outputs when enabled. Returns the number of token rows. Releases the
    GIL. Validates every row first (ValueError naming metadata[i] and the problem, or the buffer
    whose capacity is exceeded): nothing is written when a call is rejected.
    """
def prepare_decode_zos_inputs(args: PrepareArgs, metadata: SequenceMetadataPool, prev: PrepareArgs) -> int:
    """
    The decode-only ZOS builder: as prepare_zos_inputs, padded like prepare_decode_v4.
    
    args: the PrepareArgs whose buffers are written; metadata: the step's SequenceMetadataPool.
    Writes input_ids, positions, slot_mapping (block_table[p // block_size] * block_size +
    p % block_size), query_start_loc, seq_lens, block-table rows that changed, logits_indices,
    and the YOCO / Engram outputs when enabled. Returns the number of token rows. Releases the
    GIL. Validates every row first (ValueError naming metadata[i] and the problem, or the buffer
    whose capacity is exceeded): nothing is written when a call is rejected.
    """
def prepare_prompt_v4(args: PrepareArgs, metadata: SequenceMetadataPool) -> int:
    """
    Build the model inputs of a step with prefill chunks (decode rows may be mixed in), in metadata order, without padding.
    
    args: the PrepareArgs whose buffers are written; metadata: the step's SequenceMetadataPool.
    Writes input_ids, positions, slot_mapping (block_table[p // block_size] * block_size +
    p % block_size), query_start_loc, seq_lens, block-table rows that changed, logits_indices,
    and the YOCO / Engram outputs when enabled. Returns the number of token rows. Releases the
    GIL. Validates every row first (ValueError naming metadata[i] and the problem, or the buffer
    whose capacity is exceeded): nothing is written when a call is rejected.
    """
def prepare_sampler_inputs(args: PrepareArgs, metadata: SequenceMetadataPool, out: SamplerInputs) -> SamplerInputs:
    """
    Fill `out` (a SamplerInputs) for the step last prepared with `args` from `metadata` (the
    same pool, unchanged since; ValueError otherwise). One sample row per sampled token in batch
    order, then one placeholder row per padding batch row. Returns `out`. Releases the GIL while
    building; grows engine-owned storage with the GIL held. In "incremental" penalty_counts mode the
    call also hands slots to newly penalized sequences and frees (at its end) the slots of sequences
    absent from this step; the consumer must apply this call's penalty updates before the next
    call. A rejected call changes no slot.
    """
def prepare_zos_inputs(args: PrepareArgs, metadata: SequenceMetadataPool, prev: PrepareArgs) -> int:
    """
    ZOS (zero-overhead scheduling): build step N+1 while step N runs, before its sampled tokens reach the host. prev: the PrepareArgs of step N (may be args itself). A decode row of a sequence that sampled in step N becomes one token at position len(tokens) (the pending token): input_ids 0 and zos_source_index = the logits row of step N whose sampled token it is; every other token row has zos_source_index -1 (input_ids is the token). The device resolves ids = where(src >= 0, sampled[src], input_ids). Mixed prefill rows are built as in prepare_prompt_v4. Engram is refused (it hashes token values).
    
    args: the PrepareArgs whose buffers are written; metadata: the step's SequenceMetadataPool.
    Writes input_ids, positions, slot_mapping (block_table[p // block_size] * block_size +
    p % block_size), query_start_loc, seq_lens, block-table rows that changed, logits_indices,
    and the YOCO / Engram outputs when enabled. Returns the number of token rows. Releases the
    GIL. Validates every row first (ValueError naming metadata[i] and the problem, or the buffer
    whose capacity is exceeded): nothing is written when a call is rejected.
    """
def process_MTPInfo(scheduler: Scheduler, num_accepted: typing.Any, output_tokens: typing.Any, next_drafts: typing.Any = None, logprobs: typing.Any = None, topk_token_ids: typing.Any = None, topk_logprobs: typing.Any = None) -> numpy.typing.NDArray[numpy.int32]:
    """
    Apply a speculative-decoding step (MTP heads or any drafter) instead of Scheduler.update.
    
    One entry per SAMPLE row r, in the Scheduler's order (SchedulerOutputs.num_sample_rows rows,
    each scheduled sequence contributing num_samples rows, the order prepare_sampler_inputs emits
    them): num_accepted int32[R] (accepted drafts, 0..k of that row; 0 for rows without drafts),
    output_tokens int32[R, C] (the accepted drafts then the bonus/recovered token in columns
    0..num_accepted[r]), next_drafts int32[R, k'] or None (the drafts to verify next step; a row with fewer drafts
    ends them with -1, and only -1 may follow), logprobs float32[R, C] or None, topk_token_ids
    int32[R, C, K] and topk_logprobs float32[R, C, K] or None (the top-K logprobs of each appended
    token, for sequences that asked logprobs = K; given together). All borrowed read-only, C-contiguous.
    Appends the tokens one by one with the Scheduler's stop checking (a stop inside the run drops
    the later tokens), advances computed tokens by 1 + accepted, rolls back the KV slots of
    rejected drafts, stores the next drafts. The chunk completing an n > 1 prompt has n sample
    rows and no drafts (num_accepted 0): it is forked exactly as Scheduler.update forks it (children
    share the parent's full blocks; the copy of its partial last block and state clones are queued
    for the next step's blocks_to_copy / states_to_clone / states_to_zero), then row j's token (and
    next drafts) go to sample j (j = 0 the parent, then the children in creation order). Returns
    int32[R]: tokens appended per row (0 for rows of sequences aborted while the step ran).
    Validates everything first (nothing changes on error: ValueError naming the argument and row);
    releases the GIL while applying.
    """
def set_engram_lookup_table(table: typing.Any, vocab_size: typing.SupportsInt | typing.SupportsIndex) -> None:
    """
    Install the Engram vocabulary lookup table (token id -> compressed id) for the process.
    
    table: list or 1-D integer array of length ``vocab_size``, every value in ``[0, vocab_size)``;
    ``None`` removes the table. Validated fully before it replaces the old table atomically (a
    builder running in another thread keeps the table it started with). Raises ValueError /
    TypeError naming the argument and the offending index and value; on error the previous table
    stays installed.
    """
def update_prompt_logprobs(scheduler: Scheduler, sampler_inputs: SamplerInputs, logprobs: typing.Any, topk_token_ids: typing.Any = None, topk_logprobs: typing.Any = None) -> None:
    """
    Attach the prompt logprobs computed for this step's prefill chunks to their requests.
    
    sampler_inputs: the step's SamplerInputs (its prompt_logprobs rows say which prompt position
    each row scores). logprobs float32[N]: logprob of each row's target prompt token;
    topk_token_ids int32[N, k] + topk_logprobs float32[N, k] (k >= the largest top-k requested)
    or None when every request asked for 0. Chunks must arrive in order (each request continues at
    its next prompt position), else ValueError naming the row; nothing is written on error. Call it
    before Scheduler.update of the same step (so requests finishing there are still live).
    """
PLACEHOLDER_REQUEST_ID: str = '__deepinfer_placeholder__'

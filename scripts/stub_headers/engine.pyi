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

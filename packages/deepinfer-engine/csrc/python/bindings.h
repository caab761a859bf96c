// One binder per family of names of deepinfer._C.engine; module.cpp calls each once, in an
// order where every type is bound before a signature names it. The sequence and scheduler
// families have two entry points each so that the classes keep their order in the module
// (the order pybind11-stubgen writes them to the committed stubs).
#pragma once
#include <pybind11/pybind11.h>

namespace deepinfer {
// SamplingParams (validated on construction and assignment).
void bind_sampling_params(pybind11::module_& m);
// PLACEHOLDER_REQUEST_ID, SequenceStatus.
void bind_sequence_status(pybind11::module_& m);
// BlockManager, SchedulerOutputs.
void bind_scheduler_outputs(pybind11::module_& m);
// SequenceData, Sequence.
void bind_sequences(pybind11::module_& m);
// Scheduler, clone_and_zero_states_and_blocks.
void bind_scheduler(pybind11::module_& m);
// RequestOutput, RequestOutputPool, build_request_outputs, get_finished_seqs_info.
void bind_outputs(pybind11::module_& m);
// FlopsEstimator and its configuration.
void bind_flops(pybind11::module_& m);
// Engram lookup table and hashing.
void bind_engram(pybind11::module_& m);
// YocoPrefillTruncationMode, SequenceMetadata(Pool), PrepareArgs, the input builders.
void bind_inputs(pybind11::module_& m);
// SamplerInputs and its parts, prepare_sampler_inputs.
void bind_sampler(pybind11::module_& m);
// process_MTPInfo, update_prompt_logprobs: step results applied to the scheduler.
void bind_updates(pybind11::module_& m);
}  // namespace deepinfer

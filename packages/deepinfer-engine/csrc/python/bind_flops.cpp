// Python binding of FlopsEstimator.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include "python/bindings.h"
#include "python/loose_ints.h"
#include "step/flops.h"

namespace py = pybind11;

namespace deepinfer {

namespace {
// Loose int sequence (list or any integer numpy array) -> int32 vector, checked >= min_value.
// Floats and strings are refused (TypeError), like every loose integer list of the engine.
std::vector<int32_t> int_list(const py::handle& obj, const char* name, int64_t min_value) {
  return loose_ints(obj, name, min_value);
}
}  // namespace

void bind_flops(py::module_& m) {
  py::class_<FlopsEstimator>(m, "FlopsEstimator", R"doc(
Analytic FLOPs of a model step from the model's dimensions, for MFU reporting.

A multiply-add counts as 2 FLOPs. Per token: the attention projections (q, k, v, o with
grouped-query K/V widths), the MLP (dense SwiGLU: gate, up, down; MoE layers: top-k routed
plus shared experts of ``moe_intermediate_size`` and the router), and attention
``4 * num_attention_heads * head_dim`` FLOPs per (layer, attended token) over the token's
causal context, capped at ``sliding_window`` on sliding layers. Per logits row: the LM head
``2 * hidden_size * vocab_size``. Invalid dimensions raise ValueError naming the field.
)doc")
      .def(py::init([](int64_t hidden_size, int64_t num_layers, int64_t num_attention_heads, int64_t num_kv_heads,
                       int64_t head_dim, int64_t intermediate_size, int64_t vocab_size, int64_t num_experts,
                       int64_t num_experts_per_tok, int64_t moe_intermediate_size, int64_t num_shared_experts,
                       int64_t first_k_dense_layers, int64_t sliding_window,
                       std::optional<std::vector<bool>> sliding_layers) {
             FlopsConfig c{hidden_size,         num_layers,         num_attention_heads,   num_kv_heads,
                           head_dim,            intermediate_size,  vocab_size,            num_experts,
                           num_experts_per_tok, moe_intermediate_size, num_shared_experts, first_k_dense_layers,
                           sliding_window,      sliding_layers.value_or(std::vector<bool>{})};
             return FlopsEstimator(std::move(c));
           }),
           py::kw_only(), py::arg("hidden_size"), py::arg("num_layers"), py::arg("num_attention_heads"),
           py::arg("num_kv_heads") = 0, py::arg("head_dim") = 0, py::arg("intermediate_size"),
           py::arg("vocab_size"), py::arg("num_experts") = 0, py::arg("num_experts_per_tok") = 0,
           py::arg("moe_intermediate_size") = 0, py::arg("num_shared_experts") = 0,
           py::arg("first_k_dense_layers") = 0, py::arg("sliding_window") = 0,
           py::arg("sliding_layers") = py::none(),
           "Build from model dimensions. num_kv_heads=0 means num_attention_heads; head_dim=0 means "
           "hidden_size // num_attention_heads; num_experts=0 means a dense MLP on every layer; "
           "sliding_window=0 means full attention; sliding_layers (one bool per layer) picks the sliding "
           "layers, None means all of them when sliding_window > 0.")
      .def_property_readonly("linear_flops_per_token", &FlopsEstimator::linear_flops_per_token,
                             "FLOPs of the linear layers (all layers, no LM head) for one token.")
      .def_property_readonly("lm_head_flops_per_row", &FlopsEstimator::lm_head_flops_per_row,
                             "FLOPs of the LM head for one logits row: 2 * hidden_size * vocab_size.")
      .def(
          "attention_flops",
          [](const FlopsEstimator& f, int64_t context_len) {
            if (context_len < 0) throw py::value_error("context_len: must be >= 0, got " + std::to_string(context_len));
            return f.attention_flops(context_len);
          },
          py::arg("context_len"), "Attention FLOPs (all layers) of one token that attends to context_len tokens.")
      .def(
          "chunk_attention_flops",
          [](const FlopsEstimator& f, int64_t query_len, int64_t context_len) {
            if (query_len < 0 || query_len > context_len)
              throw py::value_error("query_len: must be in [0, context_len], got " + std::to_string(query_len));
            return f.chunk_attention_flops(query_len, context_len);
          },
          py::arg("query_len"), py::arg("context_len"),
          "Attention FLOPs of a causal chunk of query_len tokens ending at context_len (token j of the chunk "
          "sees context_len - query_len + j + 1 tokens).")
      .def(
          "step_flops",
          [](const FlopsEstimator& f, const py::handle& query_lens, const py::handle& context_lens,
             int64_t num_logits) {
            auto q = int_list(query_lens, "query_lens", 0);
            auto c = int_list(context_lens, "context_lens", 0);
            if (q.size() != c.size())
              throw py::value_error("context_lens: length " + std::to_string(c.size()) + " != len(query_lens) " +
                                    std::to_string(q.size()));
            for (size_t i = 0; i < q.size(); ++i)
              if (q[i] > c[i])
                throw py::value_error("query_lens[" + std::to_string(i) + "]: " + std::to_string(q[i]) +
                                      " > context_lens[" + std::to_string(i) + "] = " + std::to_string(c[i]));
            if (num_logits < 0) throw py::value_error("num_logits: must be >= 0, got " + std::to_string(num_logits));
            return f.step_flops(q.data(), c.data(), q.size(), num_logits);
          },
          py::arg("query_lens"), py::arg("context_lens"), py::arg("num_logits"),
          "FLOPs of a whole step. query_lens / context_lens: per sequence, tokens computed this step and the "
          "context length after the step (list or integer array); num_logits: LM-head rows.");
}

}  // namespace deepinfer

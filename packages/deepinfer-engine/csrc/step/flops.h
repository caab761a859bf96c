// Analytic FLOPs of a model step, for MFU reporting.
//
// Counts multiply-adds as 2 FLOPs. Per token: every linear layer (attention projections, dense
// SwiGLU MLP or MoE with top-k routed + shared experts and the router), attention scores and
// weighted values over the token's causal context (limited by a sliding window on sliding
// layers); per logits row: the LM head.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace deepinfer {

struct FlopsConfig {
  int64_t hidden_size = 0;
  int64_t num_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;  // 0: hidden_size / num_attention_heads
  int64_t intermediate_size = 0;
  int64_t vocab_size = 0;
  int64_t num_experts = 0;  // 0: dense MLP on every layer
  int64_t num_experts_per_tok = 0;
  int64_t moe_intermediate_size = 0;
  int64_t num_shared_experts = 0;
  int64_t first_k_dense_layers = 0;  // MoE models: the first k layers keep a dense MLP
  int64_t sliding_window = 0;        // 0: full attention
  std::vector<bool> sliding_layers;  // empty with sliding_window > 0: every layer slides
};

class FlopsEstimator {
 public:
  explicit FlopsEstimator(FlopsConfig cfg);  // throws InvalidArgument naming the field

  const FlopsConfig& config() const { return cfg_; }
  // Linear-layer FLOPs of one token through every layer (no LM head, no attention scores).
  int64_t linear_flops_per_token() const { return linear_per_token_; }
  // LM-head FLOPs of one logits row.
  int64_t lm_head_flops_per_row() const { return 2 * cfg_.hidden_size * cfg_.vocab_size; }
  // Attention score + value FLOPs (all layers) of one token that attends to `context_len` tokens.
  int64_t attention_flops(int64_t context_len) const;
  // Attention FLOPs of a chunk of `query_len` tokens whose last token sees `context_len` tokens
  // (causal: token j of the chunk sees context_len - query_len + j + 1 tokens).
  int64_t chunk_attention_flops(int64_t query_len, int64_t context_len) const;
  // Everything of a step: per sequence its query length and context length, plus logits rows.
  int64_t step_flops(const int32_t* query_lens, const int32_t* context_lens, size_t n, int64_t num_logits) const;

 private:
  FlopsConfig cfg_;
  int64_t linear_per_token_ = 0;
  int64_t attn_per_ctx_token_per_layer_ = 0;  // 4 * heads * head_dim
  int64_t num_sliding_layers_ = 0;
};

}  // namespace deepinfer

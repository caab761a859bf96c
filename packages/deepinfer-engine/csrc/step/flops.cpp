#include "step/flops.h"

#include <algorithm>
#include <string>

#include "core/invalid_argument.h"

namespace deepinfer {

namespace {
void require(bool ok, const char* field, int64_t value, const char* rule) {
  if (!ok) throw InvalidArgument(field, std::string(rule) + ", got " + std::to_string(value));
}

// Sum over j = 1..q of min(c0 + j, w) where c0 = context - q (tokens before the chunk).
int64_t windowed_causal_sum(int64_t q, int64_t context, int64_t w) {
  const int64_t c0 = context - q;
  auto tri = [](int64_t a, int64_t b) { return (a + b) * (b - a + 1) / 2; };  // sum a..b
  if (w <= 0) return tri(c0 + 1, c0 + q);
  // Terms c0+1 .. c0+q, each capped at w.
  const int64_t hi_uncapped = std::min(c0 + q, w);  // last uncapped value
  int64_t sum = 0;
  if (hi_uncapped >= c0 + 1) sum += tri(c0 + 1, hi_uncapped);
  const int64_t capped = c0 + q - std::max(hi_uncapped, c0);
  sum += capped * w;
  return sum;
}
}  // namespace

FlopsEstimator::FlopsEstimator(FlopsConfig cfg) : cfg_(std::move(cfg)) {
  auto& c = cfg_;
  require(c.hidden_size > 0, "hidden_size", c.hidden_size, "must be > 0");
  require(c.num_layers > 0, "num_layers", c.num_layers, "must be > 0");
  require(c.num_attention_heads > 0, "num_attention_heads", c.num_attention_heads, "must be > 0");
  if (c.num_kv_heads == 0) c.num_kv_heads = c.num_attention_heads;
  require(c.num_kv_heads > 0 && c.num_attention_heads % c.num_kv_heads == 0, "num_kv_heads", c.num_kv_heads,
          "must be > 0 and divide num_attention_heads");
  if (c.head_dim == 0) {
    require(c.hidden_size % c.num_attention_heads == 0, "head_dim", 0,
            "must be given when hidden_size is not a multiple of num_attention_heads");
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  require(c.head_dim > 0, "head_dim", c.head_dim, "must be > 0");
  require(c.intermediate_size >= 0, "intermediate_size", c.intermediate_size, "must be >= 0");
  require(c.vocab_size >= 0, "vocab_size", c.vocab_size, "must be >= 0");
  require(c.num_experts >= 0, "num_experts", c.num_experts, "must be >= 0");
  if (c.num_experts > 0) {
    require(c.num_experts_per_tok > 0 && c.num_experts_per_tok <= c.num_experts, "num_experts_per_tok",
            c.num_experts_per_tok, "must be in [1, num_experts]");
    require(c.moe_intermediate_size > 0, "moe_intermediate_size", c.moe_intermediate_size, "must be > 0 for MoE");
  }
  require(c.num_shared_experts >= 0, "num_shared_experts", c.num_shared_experts, "must be >= 0");
  require(c.first_k_dense_layers >= 0 && c.first_k_dense_layers <= c.num_layers, "first_k_dense_layers",
          c.first_k_dense_layers, "must be in [0, num_layers]");
  require(c.sliding_window >= 0, "sliding_window", c.sliding_window, "must be >= 0");
  require(c.sliding_layers.empty() || static_cast<int64_t>(c.sliding_layers.size()) == c.num_layers,
          "sliding_layers", static_cast<int64_t>(c.sliding_layers.size()), "length must equal num_layers");

  const int64_t h = c.hidden_size, qd = c.num_attention_heads * c.head_dim, kvd = c.num_kv_heads * c.head_dim;
  const int64_t attn_params = h * qd + 2 * h * kvd + qd * h;  // q, k, v, o
  const int64_t dense_mlp = 3 * h * c.intermediate_size;      // gate, up, down
  int64_t params = 0;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    params += attn_params;
    if (c.num_experts > 0 && l >= c.first_k_dense_layers) {
      params += 3 * h * c.moe_intermediate_size * (c.num_experts_per_tok + c.num_shared_experts);
      params += h * c.num_experts;  // router
    } else {
      params += dense_mlp;
    }
  }
  linear_per_token_ = 2 * params;
  attn_per_ctx_token_per_layer_ = 4 * qd;  // QK^T and PV: 2 FLOPs each per head-dim element
  if (c.sliding_window > 0) {
    num_sliding_layers_ = c.sliding_layers.empty()
                              ? c.num_layers
                              : std::count(c.sliding_layers.begin(), c.sliding_layers.end(), true);
  }
}

int64_t FlopsEstimator::attention_flops(int64_t context_len) const {
  const int64_t full = cfg_.num_layers - num_sliding_layers_;
  const int64_t win = cfg_.sliding_window > 0 ? std::min(context_len, cfg_.sliding_window) : context_len;
  return attn_per_ctx_token_per_layer_ * (full * context_len + num_sliding_layers_ * win);
}

int64_t FlopsEstimator::chunk_attention_flops(int64_t q, int64_t context) const {
  const int64_t full = cfg_.num_layers - num_sliding_layers_;
  int64_t s = full * windowed_causal_sum(q, context, 0);
  if (num_sliding_layers_) s += num_sliding_layers_ * windowed_causal_sum(q, context, cfg_.sliding_window);
  return attn_per_ctx_token_per_layer_ * s;
}

int64_t FlopsEstimator::step_flops(const int32_t* query_lens, const int32_t* context_lens, size_t n,
                                   int64_t num_logits) const {
  int64_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    total += linear_per_token_ * query_lens[i] + chunk_attention_flops(query_lens[i], context_lens[i]);
  }
  return total + num_logits * lm_head_flops_per_row();
}

}  // namespace deepinfer

// A Llama-family model's decode step (one new token per sequence) over the runtime's paged KV
// cache, all layers in one call: embedding, per layer RMSNorm -> fused q/k/v -> rotary -> KV
// write -> attention -> o_proj + residual -> RMSNorm -> gate/up -> SiLU * up -> down + residual,
// final norm and LM head. Weights, norms, rotary tables and KV caches are registered once
// (pointers into buffers the Python side keeps alive and validated at registration); a step
// passes only the step's small index arrays. No Python and no allocation per layer.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <new>
#include <vector>

#include "cpu_kernels/kernels.h"
#include "cpu_kernels/thread_pool.h"

namespace deepinfer::cpu {

struct ModelShape {
  int hidden = 0, intermediate = 0, layers = 0, heads = 0, kv_heads = 0, head_dim = 0, vocab = 0;
  float eps = 1e-5f;
};

// A weight [rows, cols] in one of the WeightKinds, rows row_bytes apart.
struct Linear {
  WeightKind kind = WeightKind::F32;
  const uint8_t* data = nullptr;
  int rows = 0, cols = 0;
  size_t row_bytes = 0;
};

// Quantized activation rows (codes, scales, sums), grown on demand.
struct ActBuffer {
  std::vector<int8_t> qs;
  std::vector<float> d, s;
  std::vector<int32_t> sum;
  void reserve(size_t rows, size_t k) {
    if (qs.size() < rows * k) {
      qs.resize(rows * k);
      d.resize(rows * k / kBlock);
      s.resize(rows * k / kBlock);
      sum.resize(rows * k / 16);
    }
  }
  Acts view() const { return Acts{qs.data(), d.data(), s.data(), sum.data()}; }
};

struct LayerWeights {
  const float* attn_norm = nullptr;
  Linear q, k, v, o;
  const float* qkv_bias = nullptr;  // [q + 2 kv] or null
  const float* ffn_norm = nullptr;
  Linear gate, up, down;
  float* kv_cache = nullptr;  // [2, cache_blocks, block_size, kv_heads, head_dim]
  bool set = false;
};

// One step's inputs (validated by the caller). A row is one token: a decode row, or one token of
// a prompt chunk (its seq_len is its position + 1; the step writes every row's k/v before any row
// attends, so a prompt's rows see the rows before them). Each row is computed alone, so its
// values do not depend on the other rows of the step (batch invariance).
struct StepInputs {
  int rows = 0;
  const int64_t* ids = nullptr;
  const int64_t* positions = nullptr;
  const int64_t* slots = nullptr;
  const int64_t* seq_lens = nullptr;      // keys row b attends over
  const int64_t* block_tables = nullptr;  // [table rows, table_width]
  int table_width = 0;
  const int64_t* table_rows = nullptr;    // row b's block table row (null: row b)
  const int64_t* logit_rows = nullptr;    // rows whose logits are wanted, in output order (null: all)
  int num_logit_rows = 0;
  const int64_t* table_of(int b) const {
    return block_tables + static_cast<size_t>(table_rows ? table_rows[b] : b) * table_width;
  }
};

// Parts of a decode step the optional phase timer tells apart (wall time on the calling thread).
enum Phase : int { kNormQuant = 0, kQkv, kRotaryKv, kAttention, kOProj, kGateUp, kDown, kHead, kPhases };
inline constexpr const char* kPhaseNames[kPhases] = {"norm_quantize", "qkv", "rotary_kv_write", "attention",
                                                     "o_proj", "gate_up_silu", "down", "lm_head"};

class DecodeModel {
 public:
  DecodeModel(const ModelShape& shape, int threads, const Kernels& kernels);

  const ModelShape& shape() const { return shape_; }
  const Kernels& kernels() const { return *kernels_; }
  int threads() const { return pool_.size(); }

  Linear embedding;
  const float* final_norm = nullptr;
  Linear head;
  const float* rope_cos = nullptr;  // [rope_positions, head_dim]
  const float* rope_sin = nullptr;
  int rope_positions = 0;
  int cache_blocks = 0, block_size = 0;  // of every layer's KV cache
  std::vector<LayerWeights> layers;

  // logits [num_logit_rows (rows when logit_rows is null), vocab]. Runs without the GIL.
  void decode(const StepInputs& in, float* logits);

  // Phase timer (off by default): when on, each step adds the wall time of its phases to
  // phase_seconds (read and reset by the caller).
  bool profiling = false;
  std::array<double, kPhases> phase_seconds{};
  int profiled_steps = 0;

  // Contention back-off (on by default): after a step that waited over a tenth of its time on
  // descheduled workers, run the next steps on the calling thread alone. solo_steps counts the
  // steps it ran alone since creation.
  bool contention_backoff = true;
  int64_t solo_steps = 0;

  // A copy of a quantized weight in ggml's layout, regrouped for the kernels (see kernels.h)
  // and owned by the model; F32 weights are returned as they are (not copied).
  Linear regrouped(const Linear& ggml);

  // y [rows, w.rows] = x [rows, w.cols] @ w^T with this model's kernels and threads (activations
  // quantized first for a quantized w): the building block, exposed for the kernel tests.
  void linear(const Linear& w, const float* x, int rows, float* y);

 private:
  void decode_layers(const StepInputs& in, float* logits);
  void ensure_scratch(int rows);
  void rms_norm(const float* x, const float* w, float* out, int rows) const;
  void quantize(const float* x, int rows, int k, ActBuffer& out) const;
  // rows of y [rows, ldy] at column offset col0 .. for the linears of `parts`, split over threads
  void run_linears(const Linear* const* parts, int num_parts, const float* xf, const Acts& xq, int rows,
                   float* y, int ldy);
  void attention(const StepInputs& in, LayerWeights& layer);
  // The step's attention work items (the same for every layer) and their scratch.
  void plan_attention(const StepInputs& in, int max_len);

  ModelShape shape_;
  const Kernels* kernels_;
  ThreadPool pool_;
  // scratch, grown on demand
  std::vector<float> x_, h_, qkv_, attn_, tmp_, gate_, up_, act_, head_in_;
  ActBuffer hq_, aq_;
  static constexpr std::align_val_t kWeightAlign{64};
  struct AlignedDelete {
    void operator()(uint8_t* p) const { ::operator delete[](p, kWeightAlign); }
  };
  using AlignedBytes = std::unique_ptr<uint8_t[], AlignedDelete>;
  std::vector<AlignedBytes> owned_;  // regrouped weights
  // Attention work: an item is query heads q0..q1 of kv head g over rows row0..row0+rows-1, which
  // share a block-table row (one sequence's speculative verify rows; else one row); query j of
  // the item's (row, head) pairs is row row0 + j / group, head g * group + j % group.
  struct AttnItem {
    int row0, g, q0, q1;
  };
  std::vector<AttnItem> attn_items_;
  static constexpr size_t kAttnWorkFloats = size_t{1} << 20;  // 4 MiB of attention scratch a thread
  std::vector<std::vector<float>> scores_;  // per thread: attend_many's work
  std::vector<std::vector<const float*>> attn_q_;  // per thread: an item's queries, outputs, lengths
  std::vector<std::vector<float*>> attn_out_;
  std::vector<std::vector<int>> attn_len_;
  int scratch_rows_ = 0;
  // Contention back-off: steps left to run on the calling thread alone, and the length of the
  // next back-off (doubles while steps keep waiting on descheduled workers).
  int solo_steps_left_ = 0, solo_backoff_ = 0;
  // Recent step time (moving average) of each mode, for the batch size it was measured at
  // (another batch size starts it over).
  struct StepTime {
    double seconds = 0.0;
    int rows = 0;
    void add(double t, int r) {
      seconds = r == rows ? 0.75 * seconds + 0.25 * t : t;
      rows = r;
    }
    bool known(int r) const { return rows == r; }
  };
  StepTime pool_time_, solo_time_;
  int pool_kept_ = 0;  // contended steps kept on the pool since one thread was last measured
};

}  // namespace deepinfer::cpu

#include "cpu_kernels/decode_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace deepinfer::cpu {

namespace {

// Output rows of a linear handed to a thread at the least (ThreadPool::run_chunks hands out
// larger pieces first): a multiple of every tile height.
constexpr int kRowGranule = 16;
constexpr double kMaxWaitShare = 0.1;
constexpr int kMinSoloSteps = 4, kMaxSoloSteps = 256;
constexpr int kRemeasureSteps = 256;

bool quantized(const Linear& w) { return w.kind != WeightKind::F32; }

// Row r of an embedding table as float32 (the same products a dequantized table holds).
void dequantize_row(const Linear& w, int r, float* out) {
  const uint8_t* row = w.data + static_cast<size_t>(r) * w.row_bytes;
  if (w.kind == WeightKind::F32) {
    std::memcpy(out, row, sizeof(float) * w.cols);
    return;
  }
  dequantize_ggml_row(w.kind, row, w.cols, out);
}

}  // namespace

DecodeModel::DecodeModel(const ModelShape& shape, int threads, const Kernels& kernels)
    : shape_(shape), kernels_(&kernels), pool_(threads) {
  layers.resize(static_cast<size_t>(shape.layers));
  const size_t threads_n = static_cast<size_t>(pool_.size());
  scores_.resize(threads_n);
  attn_q_.resize(threads_n);
  attn_out_.resize(threads_n);
  attn_len_.resize(threads_n);
}

void DecodeModel::ensure_scratch(int rows) {
  const auto& s = shape_;
  if (rows > scratch_rows_) {
    const size_t r = static_cast<size_t>(rows);
    const size_t qkv = static_cast<size_t>((s.heads + 2 * s.kv_heads) * s.head_dim);
    x_.resize(r * s.hidden);
    h_.resize(r * s.hidden);
    tmp_.resize(r * s.hidden);
    qkv_.resize(r * qkv);
    attn_.resize(r * s.heads * s.head_dim);
    gate_.resize(r * s.intermediate);
    up_.resize(r * s.intermediate);
    act_.resize(r * s.intermediate);
    hq_.reserve(r, static_cast<size_t>(s.hidden));
    aq_.reserve(r, static_cast<size_t>(std::max(s.heads * s.head_dim, s.intermediate)));
    scratch_rows_ = rows;
  }
}

void DecodeModel::rms_norm(const float* x, const float* w, float* out, int rows) const {
  const int n = shape_.hidden;
  for (int b = 0; b < rows; ++b) {
    const float* xr = x + static_cast<size_t>(b) * n;
    float* o = out + static_cast<size_t>(b) * n;
    double ss = 0.0;
    for (int i = 0; i < n; ++i) ss += static_cast<double>(xr[i]) * xr[i];
    const float r = 1.0f / std::sqrt(static_cast<float>(ss / n) + shape_.eps);
    for (int i = 0; i < n; ++i) o[i] = w[i] * (xr[i] * r);
  }
}

void DecodeModel::quantize(const float* x, int rows, int k, ActBuffer& out) const {
  const size_t nb = static_cast<size_t>(k / kBlock);
  for (int b = 0; b < rows; ++b) {
    int8_t* qs = out.qs.data() + static_cast<size_t>(b) * k;
    kernels_->quantize_row(x + static_cast<size_t>(b) * k, k, qs, out.d.data() + b * nb, out.s.data() + b * nb);
    code_sums(qs, k, out.sum.data() + 2 * b * nb);
  }
}

Linear DecodeModel::regrouped(const Linear& ggml) {
  if (!quantized(ggml)) return ggml;
  // 64-byte aligned (malloc gives 16): the AVX-512 groups' blocks of Q4_1, Q4_K and Q5_K (a
  // multiple of 64 bytes) then never split a vector load across two cache lines
  AlignedBytes buf(static_cast<uint8_t*>(::operator new[](static_cast<size_t>(ggml.rows) * ggml.row_bytes, kWeightAlign)));
  kernels_->repack(ggml.kind, ggml.data, ggml.row_bytes, ggml.rows, ggml.cols / block_weights(ggml.kind), buf.get());
  Linear out = ggml;
  out.data = buf.get();
  owned_.push_back(std::move(buf));
  return out;
}

void DecodeModel::run_linears(const Linear* const* parts, int num_parts, const float* xf, const Acts& xq,
                              int rows, float* y, int ldy) {
  int total = 0;
  for (int p = 0; p < num_parts; ++p) total += parts[p]->rows;
  const Kernels& k = *kernels_;
  pool_.run_chunks(total, kRowGranule, [&](int, int c0, int c1) {
    int start = 0;
    for (int p = 0; p < num_parts; ++p) {
      const Linear& w = *parts[p];
      const int lo = std::max(c0, start) - start, hi = std::min(c1, start + w.rows) - start;
      if (lo < hi) {
        if (quantized(w)) {
          k.gemv_quant(w.kind, w.data, w.row_bytes, w.rows, w.cols, xq, rows, y + start, ldy, lo, hi);
        } else {
          k.gemv_f32(reinterpret_cast<const float*>(w.data), w.cols, xf, rows, y + start, ldy, lo, hi);
        }
      }
      start += w.rows;
    }
  });
}

void DecodeModel::linear(const Linear& w, const float* x, int rows, float* y) {
  ActBuffer xq;
  if (quantized(w)) {
    xq.reserve(static_cast<size_t>(rows), static_cast<size_t>(w.cols));
    quantize(x, rows, w.cols, xq);
  }
  const Linear* parts[] = {&w};
  run_linears(parts, 1, x, xq.view(), rows, y, w.rows);
}

void DecodeModel::plan_attention(const StepInputs& in, int max_len) {
  const auto& s = shape_;
  const int group = s.heads / s.kv_heads;
  // runs of rows sharing a block-table row: a sequence's verify rows (table_rows says so)
  std::vector<std::pair<int, int>> runs;  // (first row, rows)
  for (int b = 0; b < in.rows; ++b) {
    if (b > 0 && in.table_rows && in.table_rows[b] == in.table_rows[b - 1]) {
      ++runs.back().second;
    } else {
      runs.emplace_back(b, 1);
    }
  }
  // Each (run, kv head) is split into enough pieces for two items a thread: with one sequence and
  // few kv heads the threads would otherwise wait on one another.
  // An item's scratch (its queries' scores) stays under kAttnWorkFloats: a long prompt chunk in
  // one step (deterministic=True) is split into items of fewer queries rather than growing it.
  const int pairs = static_cast<int>(runs.size()) * s.kv_heads;
  const int pieces = std::max(1, (2 * pool_.size() + pairs - 1) / pairs);
  const int cap = std::max<int>(1, static_cast<int>(kAttnWorkFloats / attend_work_floats(1, max_len, s.head_dim)));
  attn_items_.clear();
  int most = 1;
  for (const auto& [row0, rows] : runs) {
    const int queries = rows * group;
    const int chunk = std::min(cap, (queries + std::min(pieces, queries) - 1) / std::min(pieces, queries));
    most = std::max(most, chunk);
    for (int g = 0; g < s.kv_heads; ++g)
      for (int q0 = 0; q0 < queries; q0 += chunk) attn_items_.push_back({row0, g, q0, std::min(q0 + chunk, queries)});
  }
  const size_t work = attend_work_floats(most, max_len, s.head_dim);
  for (size_t t = 0; t < scores_.size(); ++t) {
    if (scores_[t].size() < work) scores_[t].resize(work);
    if (attn_q_[t].size() < static_cast<size_t>(most)) {
      attn_q_[t].resize(static_cast<size_t>(most));
      attn_out_[t].resize(static_cast<size_t>(most));
      attn_len_[t].resize(static_cast<size_t>(most));
    }
  }
}

void DecodeModel::attention(const StepInputs& in, LayerWeights& layer) {
  const auto& s = shape_;
  const int d = s.head_dim, group = s.heads / s.kv_heads;
  const int qkv_width = (s.heads + 2 * s.kv_heads) * d;
  const size_t token_stride = static_cast<size_t>(s.kv_heads) * d;
  const float* k_cache = layer.kv_cache;
  const float* v_cache = layer.kv_cache + static_cast<size_t>(cache_blocks) * block_size * token_stride;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  const Kernels& k = *kernels_;
  pool_.run_chunks(static_cast<int>(attn_items_.size()), 1, [&](int tid, int item0, int item1) {
    const size_t t = static_cast<size_t>(tid);
    float* work = scores_[t].data();
    const float** qs = attn_q_[t].data();
    float** outs = attn_out_[t].data();
    int* lens = attn_len_[t].data();
    for (int item = item0; item < item1; ++item) {
      const AttnItem& a = attn_items_[static_cast<size_t>(item)];
      int n = 0;
      for (int j = a.q0; j < a.q1; ++j, ++n) {
        const int b = a.row0 + j / group, h = a.g * group + j % group;
        qs[n] = qkv_.data() + static_cast<size_t>(b) * qkv_width + static_cast<size_t>(h) * d;
        outs[n] = attn_.data() + (static_cast<size_t>(b) * s.heads + h) * d;
        lens[n] = static_cast<int>(in.seq_lens[b]);
      }
      const size_t head_at = static_cast<size_t>(a.g) * d;
      k.attend_many(qs, outs, lens, n, d, k_cache + head_at, v_cache + head_at, token_stride, in.table_of(a.row0),
                    block_size, scale, work);
    }
  });
}

void DecodeModel::decode(const StepInputs& in, float* logits) {
  const auto step_start = std::chrono::steady_clock::now();
  if (!contention_backoff) solo_steps_left_ = solo_backoff_ = 0;
  const bool solo = solo_steps_left_ > 0;
  pool_.set_solo(solo);
  if (solo) {
    --solo_steps_left_;
    ++solo_steps;
  }
  decode_layers(in, logits);
  pool_.park();
  if (pool_.size() == 1) return;
  const double step = std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start).count();
  if (solo) {
    solo_time_.add(step, in.rows);
    return;
  }
  pool_time_.add(step, in.rows);
  // A step whose caller spent over a tenth of it waiting on workers that lost their core (a busy
  // machine) may be slower than one thread alone: run the next steps alone, 4, 8, ... up to 256
  // of them while that keeps happening, then try the pool again -- unless one thread alone,
  // measured at this batch size, was no faster than the pool with its waits (a VM whose vCPUs
  // are briefly preempted: the pool still wins). That measure is dropped now and then
  // (kRemeasureSteps contended steps) so the choice follows the machine.
  if (pool_.take_wait_seconds() > kMaxWaitShare * step) {
    if (solo_time_.known(in.rows) && solo_time_.seconds >= pool_time_.seconds) {
      if (++pool_kept_ >= kRemeasureSteps) {
        solo_time_ = {};
        pool_kept_ = 0;
      }
      return;
    }
    solo_backoff_ = std::min(kMaxSoloSteps, std::max(kMinSoloSteps, 2 * solo_backoff_));
    solo_steps_left_ = solo_backoff_;
  } else {
    solo_backoff_ /= 2;
  }
}

void DecodeModel::decode_layers(const StepInputs& in, float* logits) {
  const auto& s = shape_;
  const int rows = in.rows, H = s.hidden, I = s.intermediate, d = s.head_dim;
  const int q_width = s.heads * d, kv_width = s.kv_heads * d, qkv_width = q_width + 2 * kv_width;
  int max_len = 1;
  for (int b = 0; b < rows; ++b) max_len = std::max(max_len, static_cast<int>(in.seq_lens[b]));
  ensure_scratch(std::max(rows, in.logit_rows ? in.num_logit_rows : 0));
  plan_attention(in, max_len);
  float *x = x_.data(), *h = h_.data(), *tmp = tmp_.data();
  for (int b = 0; b < rows; ++b) dequantize_row(embedding, static_cast<int>(in.ids[b]), x + static_cast<size_t>(b) * H);
  const size_t token_stride = static_cast<size_t>(kv_width);
  using clock = std::chrono::steady_clock;
  auto last = profiling ? clock::now() : clock::time_point{};
  // phase timer: the time since the previous mark goes to `phase`
  auto mark = [&](Phase phase) {
    if (!profiling) return;
    const auto t = clock::now();
    phase_seconds[phase] += std::chrono::duration<double>(t - last).count();
    last = t;
  };
  for (auto& layer : layers) {
    // attention block
    rms_norm(x, layer.attn_norm, h, rows);
    if (quantized(layer.q) || quantized(layer.k) || quantized(layer.v)) quantize(h, rows, H, hq_);
    const Linear* qkv_parts[] = {&layer.q, &layer.k, &layer.v};
    mark(kNormQuant);
    run_linears(qkv_parts, 3, h, hq_.view(), rows, qkv_.data(), qkv_width);
    mark(kQkv);
    for (int b = 0; b < rows; ++b) {
      float* row = qkv_.data() + static_cast<size_t>(b) * qkv_width;
      if (layer.qkv_bias)
        for (int i = 0; i < qkv_width; ++i) row[i] += layer.qkv_bias[i];
      // rotary (rotate_half layout) on the q and k heads, which sit side by side
      const float* cos = rope_cos + static_cast<size_t>(in.positions[b]) * d;
      const float* sin = rope_sin + static_cast<size_t>(in.positions[b]) * d;
      const int half = d / 2;
      for (int head = 0; head < s.heads + s.kv_heads; ++head) {
        float* v = row + head * d;
        for (int i = 0; i < half; ++i) {
          const float x1 = v[i], x2 = v[i + half];
          v[i] = x1 * cos[i] + (-x2) * sin[i];
          v[i + half] = x2 * cos[i + half] + x1 * sin[i + half];
        }
      }
      const size_t slot = static_cast<size_t>(in.slots[b]);
      float* k_dst = layer.kv_cache + slot * token_stride;
      float* v_dst = layer.kv_cache + (static_cast<size_t>(cache_blocks) * block_size + slot) * token_stride;
      std::memcpy(k_dst, row + q_width, sizeof(float) * kv_width);
      std::memcpy(v_dst, row + q_width + kv_width, sizeof(float) * kv_width);
    }
    mark(kRotaryKv);
    attention(in, layer);
    mark(kAttention);
    if (quantized(layer.o)) quantize(attn_.data(), rows, q_width, aq_);
    mark(kNormQuant);
    const Linear* o_parts[] = {&layer.o};
    run_linears(o_parts, 1, attn_.data(), aq_.view(), rows, tmp, H);
    for (size_t i = 0; i < static_cast<size_t>(rows) * H; ++i) x[i] += tmp[i];
    mark(kOProj);
    // MLP block
    rms_norm(x, layer.ffn_norm, h, rows);
    if (quantized(layer.gate) || quantized(layer.up)) quantize(h, rows, H, hq_);
    mark(kNormQuant);
    const Kernels& k = *kernels_;
    pool_.run_chunks(I, kRowGranule, [&](int, int j0, int j1) {
      for (const auto* wp : {&layer.gate, &layer.up}) {
        float* y = wp == &layer.gate ? gate_.data() : up_.data();
        if (quantized(*wp)) {
          k.gemv_quant(wp->kind, wp->data, wp->row_bytes, wp->rows, H, hq_.view(), rows, y, I, j0, j1);
        } else {
          k.gemv_f32(reinterpret_cast<const float*>(wp->data), H, h, rows, y, I, j0, j1);
        }
      }
      for (int b = 0; b < rows; ++b) {
        const size_t o = static_cast<size_t>(b) * I + j0;
        k.silu_mul(gate_.data() + o, up_.data() + o, act_.data() + o, j1 - j0);
      }
    });
    mark(kGateUp);
    if (quantized(layer.down)) quantize(act_.data(), rows, I, aq_);
    mark(kNormQuant);
    const Linear* down_parts[] = {&layer.down};
    run_linears(down_parts, 1, act_.data(), aq_.view(), rows, tmp, H);
    for (size_t i = 0; i < static_cast<size_t>(rows) * H; ++i) x[i] += tmp[i];
    mark(kDown);
  }
  // LM head over the wanted rows only (a prompt chunk wants its last row's logits)
  const float* head_x = x;
  int head_rows = rows;
  if (in.logit_rows) {
    head_rows = in.num_logit_rows;
    head_in_.resize(static_cast<size_t>(head_rows) * H);
    for (int i = 0; i < head_rows; ++i)
      std::memcpy(head_in_.data() + static_cast<size_t>(i) * H, x + static_cast<size_t>(in.logit_rows[i]) * H,
                  sizeof(float) * H);
    head_x = head_in_.data();
  }
  if (head_rows > 0) {
    rms_norm(head_x, final_norm, h, head_rows);
    if (quantized(head)) quantize(h, head_rows, H, hq_);
    const Linear* head_parts[] = {&head};
    mark(kNormQuant);
    run_linears(head_parts, 1, h, hq_.view(), head_rows, logits, head.rows);
  }
  mark(kHead);
  if (profiling) ++profiled_steps;
}

}  // namespace deepinfer::cpu

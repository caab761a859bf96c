// Portable kernels (any CPU): the reference the vector ones are tested against, and the
// fallback where no vector table applies.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "cpu_kernels/kernels.h"

namespace deepinfer::cpu {

float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x3FFu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: value = mant * 2^-24
      float f = std::ldexp(static_cast<float>(mant), -24);
      std::memcpy(&bits, &f, 4);
      bits |= sign;
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

namespace {

inline float half_of(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return fp16_to_float(h);
}

// Code j (< 32) of a Q5_0 block: nibble | fifth bit << 4 (0..31; the weight is (code - 16) * d).
inline int q5_0_code(const uint8_t* blk, int j) {
  uint32_t qh;
  std::memcpy(&qh, blk + 2, 4);
  const uint8_t* qs = blk + 6;
  const int lo = j < 16 ? qs[j] & 0x0F : qs[j - 16] >> 4;
  return lo | static_cast<int>((qh >> j) & 1u) << 4;
}

// Scale and min (6 bits each) of sub-block j (< 8) of a Q4_K/Q5_K super-block's 12 scale bytes.
inline void scale_min_k4(int j, const uint8_t* q, int& sc, int& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Codes of sub-block j (< 8, 32 weights) of a K-quant super-block: Q4_K 0..15, Q5_K 0..31, Q6_K
// 0..63 (the weight's offset -32 not applied).
void k_codes(WeightKind kind, const uint8_t* blk, int j, int* q) {
  if (kind == WeightKind::Q6_K) {
    const int h = j / 4, u = j % 4;
    const uint8_t* ql = blk + 64 * h + 32 * (u & 1);
    const uint8_t* qh = blk + 128 + 32 * h;
    for (int l = 0; l < 32; ++l) q[l] = ((ql[l] >> (4 * (u >> 1))) & 0x0F) | ((qh[l] >> (2 * u)) & 3) << 4;
    return;
  }
  const uint8_t* qs = blk + (kind == WeightKind::Q5_K ? 48 : 16) + 32 * (j / 2);
  for (int l = 0; l < 32; ++l) {
    q[l] = (qs[l] >> (4 * (j & 1))) & 0x0F;
    if (kind == WeightKind::Q5_K) q[l] |= ((blk[16 + l] >> j) & 1) << 4;
  }
}

}  // namespace

void dequantize_ggml_row(WeightKind kind, const uint8_t* src, int cols, float* out) {
  const size_t bb = block_bytes(kind);
  const int bw = block_weights(kind);
  for (int i = 0; i < cols / bw; ++i) {
    const uint8_t* blk = src + i * bb;
    float* o = out + i * bw;
    switch (kind) {
      case WeightKind::F32: std::memcpy(o, blk, sizeof(float) * kBlock); break;
      case WeightKind::Q8_0: {
        const float d = half_of(blk);
        for (int j = 0; j < kBlock; ++j) o[j] = static_cast<float>(static_cast<int8_t>(blk[2 + j])) * d;
        break;
      }
      case WeightKind::Q4_0: {
        const float d = half_of(blk);
        for (int j = 0; j < 16; ++j) {
          o[j] = static_cast<float>((blk[2 + j] & 0x0F) - 8) * d;
          o[j + 16] = static_cast<float>((blk[2 + j] >> 4) - 8) * d;
        }
        break;
      }
      case WeightKind::Q4_1: {
        const float d = half_of(blk), m = half_of(blk + 2);
        for (int j = 0; j < 16; ++j) {
          o[j] = d * static_cast<float>(blk[4 + j] & 0x0F) + m;
          o[j + 16] = d * static_cast<float>(blk[4 + j] >> 4) + m;
        }
        break;
      }
      case WeightKind::Q5_0: {
        const float d = half_of(blk);
        for (int j = 0; j < kBlock; ++j) o[j] = d * static_cast<float>(q5_0_code(blk, j) - 16);
        break;
      }
      case WeightKind::Q4_K:
      case WeightKind::Q5_K: {
        const float d = half_of(blk), dmin = half_of(blk + 2);
        int q[32];
        for (int j = 0; j < 8; ++j) {
          int sc, m;
          scale_min_k4(j, blk + 4, sc, m);
          const float ds = d * static_cast<float>(sc), dm = dmin * static_cast<float>(m);
          k_codes(kind, blk, j, q);
          for (int l = 0; l < 32; ++l) o[32 * j + l] = ds * static_cast<float>(q[l]) - dm;
        }
        break;
      }
      case WeightKind::Q6_K: {
        const float d = half_of(blk + 208);
        const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
        int q[32];
        for (int j = 0; j < 8; ++j) {
          k_codes(kind, blk, j, q);
          for (int l = 0; l < 32; ++l)
            o[32 * j + l] = d * static_cast<float>(sc[2 * j + l / 16]) * static_cast<float>(q[l] - 32);
        }
        break;
      }
    }
  }
}

void repack_row(WeightKind kind, const uint8_t* src, int nb, uint8_t* dst) {
  if (as_stored(kind)) {
    std::memcpy(dst, src, block_bytes(kind) * static_cast<size_t>(nb));
    return;
  }
  const size_t bb = block_bytes(kind), cb = code_bytes(kind);
  const size_t head = bb - cb;  // fp16 d (and m) before the codes
  uint8_t* scales = dst + nb * cb;
  for (int i = 0; i < nb; ++i) {
    const uint8_t* blk = src + i * bb;
    std::memcpy(scales + 2 * i, blk, 2);
    if (kind == WeightKind::Q4_1) std::memcpy(scales + 2 * (nb + i), blk + 2, 2);
    if (kind == WeightKind::Q5_0) std::memcpy(scales + 2 * nb + 4 * i, blk + 2, 4);
  }
  if (kind == WeightKind::Q8_0) {
    for (int i = 0; i < nb; ++i) std::memcpy(dst + i * cb, src + i * bb + head, cb);
    return;
  }
  int i = 0;
  for (; i + 2 <= nb; i += 2) {  // Q4 pairs: weight j of block i low, of block i + 1 high
    const uint8_t* a = src + i * bb + head;
    const uint8_t* b = a + bb;
    uint8_t* out = dst + i * cb;
    for (int j = 0; j < 32; ++j) {
      const int qa = j < 16 ? a[j] & 0x0F : a[j - 16] >> 4;
      const int qb = j < 16 ? b[j] & 0x0F : b[j - 16] >> 4;
      out[j] = static_cast<uint8_t>(qa | qb << 4);
    }
  }
  if (i < nb) std::memcpy(dst + i * cb, src + i * bb + head, cb);  // odd last block: ggml's layout
}

void repack_each(void (*row_fn)(WeightKind, const uint8_t*, int, uint8_t*), WeightKind kind, const uint8_t* src,
                 size_t row_bytes, int rows, int nb, uint8_t* dst) {
  for (int r = 0; r < rows; ++r) row_fn(kind, src + static_cast<size_t>(r) * row_bytes, nb, dst + static_cast<size_t>(r) * row_bytes);
}

Acts acts_from_row(const Acts& x, int b, int k) {
  const size_t nb = static_cast<size_t>(k / kBlock) * static_cast<size_t>(b);
  return Acts{x.qs + static_cast<size_t>(b) * static_cast<size_t>(k), x.d + nb, x.s + nb, x.sum ? x.sum + 2 * nb : nullptr};
}

void code_sums(const int8_t* qs, int k, int32_t* out) {
  for (int i = 0; i < k / 16; ++i) {
    int32_t sum = 0;
    for (int j = 0; j < 16; ++j) sum += qs[i * 16 + j];
    out[i] = sum;
  }
}

namespace {

// Code j (< 32) of block i of a regrouped Q4 row of nb blocks.
int q4_code(const uint8_t* codes, int nb, int i, int j) {
  if ((nb & 1) && i == nb - 1) {
    const uint8_t b = codes[i * 16 + (j & 15)];
    return j < 16 ? b & 0x0F : b >> 4;
  }
  const uint8_t b = codes[(i & ~1) * 16 + j];
  return (i & 1) ? b >> 4 : b & 0x0F;
}

inline float half_at(const uint8_t* p) { return half_of(p); }

// One regrouped weight row of `kind` against one activation row (codes xq, block scales xd, block
// sums xs), k inputs. The integer dot per block of 32, then per kind: Q4_0/Q4_1/Q5_0 (codes of
// Q5_0: nibble | fifth bit << 4) d xd dot + offset xs (offset -8 d, m, -16 d); Q8_0 d xd dot; Q4_K/Q5_K (sub-block j of
// super-block s is activation block 8 s + j) d sc_j xd dot - dmin m_j xs; Q6_K the two 16-weight
// halves' dots of (q - 32) weighted by their int8 scales, times d xd.
float row_dot(WeightKind kind, const uint8_t* row, int k, const int8_t* xq, const float* xd, const float* xs) {
  const int nb = k / kBlock;
  float acc = 0.0f;
  if (k_quant(kind)) {
    const size_t bb = block_bytes(kind);
    int q[32];
    for (int i = 0; i < nb; ++i) {
      const uint8_t* blk = row + static_cast<size_t>(i / 8) * bb;
      const int j = i % 8;
      const int8_t* xi = xq + i * kBlock;
      k_codes(kind, blk, j, q);
      if (kind == WeightKind::Q6_K) {
        const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
        int32_t lo = 0, hi = 0;
        for (int l = 0; l < 16; ++l) lo += (q[l] - 32) * xi[l];
        for (int l = 16; l < 32; ++l) hi += (q[l] - 32) * xi[l];
        acc += half_at(blk + 208) * xd[i] * static_cast<float>(sc[2 * j] * lo + sc[2 * j + 1] * hi);
        continue;
      }
      int sc, m;
      scale_min_k4(j, blk + 4, sc, m);
      int32_t dot = 0;
      for (int l = 0; l < 32; ++l) dot += q[l] * xi[l];
      acc += half_at(blk) * static_cast<float>(sc) * xd[i] * static_cast<float>(dot) -
             half_at(blk + 2) * static_cast<float>(m) * xs[i];
    }
    return acc;
  }
  const size_t cb = code_bytes(kind);
  const uint8_t* scales = row + nb * cb;
  for (int i = 0; i < nb; ++i) {
    const int8_t* xi = xq + i * kBlock;
    int32_t sum = 0;
    const float dw = half_at(scales + 2 * i);
    if (kind == WeightKind::Q8_0) {
      const int8_t* qs = reinterpret_cast<const int8_t*>(row + i * cb);
      for (int j = 0; j < kBlock; ++j) sum += qs[j] * xi[j];
      acc += dw * xd[i] * static_cast<float>(sum);
      continue;
    }
    if (kind == WeightKind::Q5_0) {
      uint32_t qh;
      std::memcpy(&qh, scales + 2 * nb + 4 * i, 4);
      for (int j = 0; j < kBlock; ++j) sum += (q4_code(row, nb, i, j) | static_cast<int>((qh >> j) & 1u) << 4) * xi[j];
    } else {
      for (int j = 0; j < kBlock; ++j) sum += q4_code(row, nb, i, j) * xi[j];
    }
    const float offset = kind == WeightKind::Q4_1   ? half_at(scales + 2 * (nb + i))
                         : kind == WeightKind::Q5_0 ? -16.0f * dw
                                                    : -8.0f * dw;
    acc += dw * xd[i] * static_cast<float>(sum) + offset * xs[i];
  }
  return acc;
}

void gemv_quant(WeightKind kind, const uint8_t* w, size_t row_bytes, int /*n_rows*/, int k, const Acts& x, int rows,
                float* y, int ldy, int n0, int n1) {
  const int nb = k / kBlock;
  for (int n = n0; n < n1; ++n)
    for (int b = 0; b < rows; ++b)
      y[static_cast<size_t>(b) * ldy + n] =
          row_dot(kind, w + static_cast<size_t>(n) * row_bytes, k, x.qs + static_cast<size_t>(b) * k,
                  x.d + static_cast<size_t>(b) * nb, x.s + static_cast<size_t>(b) * nb);
}

float dot(const float* a, const float* b, int n) {
  float acc = 0.0f;
  for (int i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

void gemv_f32(const float* w, int k, const float* x, int rows, float* y, int ldy, int n0, int n1) {
  for (int n = n0; n < n1; ++n)
    for (int b = 0; b < rows; ++b)
      y[static_cast<size_t>(b) * ldy + n] = dot(w + static_cast<size_t>(n) * k, x + static_cast<size_t>(b) * k, k);
}

void quantize_row(const float* x, int k, int8_t* qs, float* d_out, float* s_out) {
  for (int i = 0; i < k / kBlock; ++i) {
    const float* v = x + i * kBlock;
    float amax = 0.0f;
    bool finite = true;
    for (int j = 0; j < kBlock; ++j) {
      amax = std::fmax(amax, std::fabs(v[j]));
      finite = finite && std::isfinite(v[j]);
    }
    const float d = amax / 127.0f;
    const float id = d > 0.0f ? 1.0f / d : 0.0f;
    int32_t sum = 0;
    for (int j = 0; j < kBlock; ++j) {
      const float r = std::nearbyint(v[j] * id);
      const int q = r >= -127.0f && r <= 127.0f ? static_cast<int>(r) : 0;  // NaN/inf input: 0, not UB
      qs[i * kBlock + j] = static_cast<int8_t>(q);
      sum += q;
    }
    // a NaN/inf activation makes its block's scale NaN: the products say so, as float ones would
    d_out[i] = finite ? d : NAN;
    s_out[i] = finite ? d * static_cast<float>(sum) : NAN;
  }
}

void axpy(float a, const float* x, float* y, int n) {
  for (int i = 0; i < n; ++i) y[i] += a * x[i];
}

void silu_mul(const float* gate, const float* up, float* out, int n) {
  for (int i = 0; i < n; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

}  // namespace

void attend_with(float (*dot_fn)(const float*, const float*, int), void (*axpy_fn)(float, const float*, float*, int),
                 const float* q, int d, const float* k, const float* v, size_t stride, const int64_t* table,
                 int block_size, int len, float scale, float* scores, float* out) {
  float m = -INFINITY;
  for (int t = 0; t < len; ++t) {
    const size_t slot = static_cast<size_t>(table[t / block_size]) * block_size + t % block_size;
    scores[t] = dot_fn(q, k + slot * stride, d) * scale;
    m = std::fmax(m, scores[t]);
  }
  std::fill(out, out + d, 0.0f);
  float sum = 0.0f;
  for (int t = 0; t < len; ++t) {
    const float p = std::exp(scores[t] - m);
    sum += p;
    const size_t slot = static_cast<size_t>(table[t / block_size]) * block_size + t % block_size;
    axpy_fn(p, v + slot * stride, out, d);
  }
  const float inv = 1.0f / sum;
  for (int i = 0; i < d; ++i) out[i] *= inv;
}

void attend_each(void (*attend_fn)(const float*, int, const float*, const float*, size_t, const int64_t*, int, int,
                                   float, float*, float*),
                 const float* const* qs, float* const* outs, const int* lens, int n, int d, const float* k,
                 const float* v, size_t stride, const int64_t* table, int block_size, float scale, float* work) {
  for (int i = 0; i < n; ++i) attend_fn(qs[i], d, k, v, stride, table, block_size, lens[i], scale, work, outs[i]);
}

namespace {

void attend(const float* q, int d, const float* k, const float* v, size_t stride, const int64_t* table,
            int block_size, int len, float scale, float* scores, float* out) {
  attend_with(dot, axpy, q, d, k, v, stride, table, block_size, len, scale, scores, out);
}

void attend_many(const float* const* qs, float* const* outs, const int* lens, int n, int d, const float* k,
                 const float* v, size_t stride, const int64_t* table, int block_size, float scale, float* work) {
  attend_each(attend, qs, outs, lens, n, d, k, v, stride, table, block_size, scale, work);
}

void repack(WeightKind kind, const uint8_t* src, size_t row_bytes, int rows, int nb, uint8_t* dst) {
  repack_each(repack_row, kind, src, row_bytes, rows, nb, dst);
}

const Kernels kGeneric{"generic", gemv_quant, gemv_f32, quantize_row, dot, axpy, silu_mul, attend, attend_many,
                       repack};

}  // namespace

const Kernels& generic_kernels() { return kGeneric; }

const Kernels& best_kernels() {
#if defined(DEEPINFER_HAVE_AVX2_KERNELS)
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                           __builtin_cpu_supports("f16c");
  static const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  if (avx512) return avx512_kernels();
  if (avx2) return avx2_kernels();
#endif
  return kGeneric;
}

}  // namespace deepinfer::cpu

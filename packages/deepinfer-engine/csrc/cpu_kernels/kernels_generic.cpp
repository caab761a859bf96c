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

void repack_row(WeightKind kind, const uint8_t* src, int nb, uint8_t* dst) {
  const size_t bb = block_bytes(kind), cb = code_bytes(kind);
  const size_t head = bb - cb;  // fp16 d (and m) before the codes
  uint8_t* scales = dst + nb * cb;
  for (int i = 0; i < nb; ++i) {
    const uint8_t* blk = src + i * bb;
    std::memcpy(scales + 2 * i, blk, 2);
    if (kind == WeightKind::Q4_1) std::memcpy(scales + 2 * (nb + i), blk + 2, 2);
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

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return fp16_to_float(h);
}

void gemv_quant(WeightKind kind, const uint8_t* w, size_t row_bytes, int k, const Acts& x, int rows,
                float* y, int ldy, int n0, int n1) {
  const int nb = k / kBlock;
  const size_t cb = code_bytes(kind);
  for (int n = n0; n < n1; ++n) {
    const uint8_t* row = w + static_cast<size_t>(n) * row_bytes;
    const uint8_t* scales = row + nb * cb;
    for (int b = 0; b < rows; ++b) {
      const int8_t* xq = x.qs + static_cast<size_t>(b) * k;
      const float* xd = x.d + static_cast<size_t>(b) * nb;
      const float* xs = x.s + static_cast<size_t>(b) * nb;
      float acc = 0.0f;
      for (int i = 0; i < nb; ++i) {
        const float dw = half_at(scales + 2 * i);
        const int8_t* xi = xq + i * kBlock;
        int32_t sum = 0;
        if (kind == WeightKind::Q8_0) {
          const int8_t* qs = reinterpret_cast<const int8_t*>(row + i * cb);
          for (int j = 0; j < kBlock; ++j) sum += qs[j] * xi[j];
          acc += dw * xd[i] * static_cast<float>(sum);
          continue;
        }
        for (int j = 0; j < kBlock; ++j) sum += q4_code(row, nb, i, j) * xi[j];
        const float offset = kind == WeightKind::Q4_1 ? half_at(scales + 2 * (nb + i)) : -8.0f * dw;
        acc += dw * xd[i] * static_cast<float>(sum) + offset * xs[i];
      }
      y[static_cast<size_t>(b) * ldy + n] = acc;
    }
  }
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

namespace {

void attend(const float* q, int d, const float* k, const float* v, size_t stride, const int64_t* table,
            int block_size, int len, float scale, float* scores, float* out) {
  attend_with(dot, axpy, q, d, k, v, stride, table, block_size, len, scale, scores, out);
}

const Kernels kGeneric{"generic", gemv_quant, gemv_f32, quantize_row, dot, axpy, silu_mul, attend};

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

// AVX-512 VNNI kernels (x86-64 with AVX512F/BW/VL/VNNI): the quantized GEMV takes two blocks per
// 512-bit integer dot (vpdpbusd); the float kernels are the AVX2 ones. Like kernels_avx2.cpp,
// this file alone is built for its instruction set, only called after best_kernels() found it
// at run time, and shares no inline functions or templates with other files.
#include <immintrin.h>

#include <cstring>

#include "cpu_kernels/kernels.h"

namespace deepinfer::cpu {
namespace {

constexpr int kChunk = 64;  // blocks whose scale products are kept on the stack at once

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// Codes of blocks i and i + 1 (adjacent in a regrouped row) as 64 unsigned/signed bytes in
// element order: [block i: 32][block i + 1: 32].
template <WeightKind K>
inline __m512i pair_codes(const uint8_t* codes) {
  if constexpr (K == WeightKind::Q8_0) {
    return _mm512_loadu_si512(codes);
  } else {
    const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes));  // [c_i | c_i+1]
    __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(t), _mm256_srli_epi16(t, 4), 1);
    z = _mm512_and_si512(z, _mm512_set1_epi8(0x0F));  // [lo_i, lo_i+1, hi_i, hi_i+1]
    return _mm512_shuffle_i64x2(z, z, 0xD8);          // [lo_i, hi_i, lo_i+1, hi_i+1]
  }
}

template <int R, WeightKind K>
void row_dots(const uint8_t* row, int nb, int k, const Acts& x, float* y, int ldy) {
  constexpr size_t cb = code_bytes(K);
  const uint8_t* d_half = row + static_cast<size_t>(nb) * cb;
  const uint8_t* m_half = d_half + 2 * static_cast<size_t>(nb);
  __m512 acc[R];
  __m256 off[R];
  float tail[R];
  alignas(64) float ds[R][kChunk];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm512_setzero_ps();
    off[r] = _mm256_setzero_ps();
    tail[r] = 0.0f;
  }
  // lanes 0-7 take the scale of the pair's first block, lanes 8-15 of its second
  const __m512i pair_index = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  for (int c0 = 0; c0 < nb; c0 += kChunk) {
    const int c1 = nb < c0 + kChunk ? nb : c0 + kChunk;
    int i = c0;
    for (; i + 8 <= c1; i += 8) {
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d_half + 2 * i)));
      __m256 mw = _mm256_setzero_ps();
      if constexpr (K == WeightKind::Q4_1) mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m_half + 2 * i)));
      if constexpr (K == WeightKind::Q4_0) mw = _mm256_mul_ps(dw, _mm256_set1_ps(-8.0f));
      for (int r = 0; r < R; ++r) {
        const size_t at = static_cast<size_t>(r) * nb + i;
        _mm256_storeu_ps(ds[r] + (i - c0), _mm256_mul_ps(dw, _mm256_loadu_ps(x.d + at)));
        if constexpr (K != WeightKind::Q8_0) off[r] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(x.s + at), off[r]);
      }
    }
    for (; i < c1; ++i) {
      const float dw = half_at(d_half + 2 * i);
      const float mw = K == WeightKind::Q4_1 ? half_at(m_half + 2 * i) : -8.0f * dw;
      for (int r = 0; r < R; ++r) {
        const size_t at = static_cast<size_t>(r) * nb + i;
        ds[r][i - c0] = dw * x.d[at];
        if constexpr (K != WeightKind::Q8_0) tail[r] += mw * x.s[at];
      }
    }
    for (i = c0; i + 2 <= c1; i += 2) {
      const __m512i wq = pair_codes<K>(row + static_cast<size_t>(i) * cb);
      __m512i wu = wq;
      __mmask64 neg = 0;
      if constexpr (K == WeightKind::Q8_0) {
        wu = _mm512_abs_epi8(wq);
        neg = _mm512_movepi8_mask(wq);
      }
      for (int r = 0; r < R; ++r) {
        __m512i xq = _mm512_loadu_si512(x.qs + static_cast<size_t>(r) * k + i * kBlock);
        if constexpr (K == WeightKind::Q8_0) xq = _mm512_mask_sub_epi8(xq, neg, _mm512_setzero_si512(), xq);
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wu, xq);
        const __m512 scale = _mm512_permutexvar_ps(
            pair_index, _mm512_castps256_ps512(_mm256_castps128_ps256(_mm_loadl_pi(_mm_setzero_ps(),
                                                                                    reinterpret_cast<const __m64*>(&ds[r][i - c0])))));
        acc[r] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(dot), acc[r]);
      }
    }
    if (i < c1) {  // odd block count: the last block alone, on 256-bit lanes
      const uint8_t* codes = row + static_cast<size_t>(i) * cb;
      __m256i wq;
      if constexpr (K == WeightKind::Q8_0) {
        wq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes));
      } else {
        const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
        wq = _mm256_and_si256(_mm256_insertf128_si256(_mm256_castsi128_si256(t), _mm_srli_epi16(t, 4), 1),
                              _mm256_set1_epi8(0x0F));
      }
      for (int r = 0; r < R; ++r) {
        __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.qs + static_cast<size_t>(r) * k + i * kBlock));
        __m256i wu = wq;
        if constexpr (K == WeightKind::Q8_0) {
          wu = _mm256_sign_epi8(wq, wq);
          xq = _mm256_sign_epi8(xq, wq);
        }
        const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wu, xq);
        acc[r] = _mm512_add_ps(acc[r], _mm512_castps256_ps512(_mm256_mul_ps(_mm256_set1_ps(ds[r][i - c0]),
                                                                            _mm256_cvtepi32_ps(dot))));
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m256 o = off[r];
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(o), _mm256_extractf128_ps(o, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    y[static_cast<size_t>(r) * ldy] = _mm512_reduce_add_ps(acc[r]) + _mm_cvtss_f32(s) + tail[r];
  }
}

template <WeightKind K>
void gemv_kind(const uint8_t* w, size_t row_bytes, int k, const Acts& x, int rows, float* y, int ldy, int n0, int n1) {
  const int nb = k / kBlock;
  for (int n = n0; n < n1; ++n) {
    const uint8_t* row = w + static_cast<size_t>(n) * row_bytes;
    for (int b = 0; b < rows;) {
      const Acts xb{x.qs + static_cast<size_t>(b) * k, x.d + static_cast<size_t>(b) * nb, x.s + static_cast<size_t>(b) * nb};
      float* yb = y + static_cast<size_t>(b) * ldy + n;
      switch (rows - b) {
        case 1: row_dots<1, K>(row, nb, k, xb, yb, ldy); b += 1; break;
        case 2: row_dots<2, K>(row, nb, k, xb, yb, ldy); b += 2; break;
        case 3: row_dots<3, K>(row, nb, k, xb, yb, ldy); b += 3; break;
        default: row_dots<4, K>(row, nb, k, xb, yb, ldy); b += 4; break;
      }
    }
  }
}

void gemv_quant(WeightKind kind, const uint8_t* w, size_t row_bytes, int k, const Acts& x, int rows,
                float* y, int ldy, int n0, int n1) {
  switch (kind) {
    case WeightKind::Q4_0: gemv_kind<WeightKind::Q4_0>(w, row_bytes, k, x, rows, y, ldy, n0, n1); break;
    case WeightKind::Q4_1: gemv_kind<WeightKind::Q4_1>(w, row_bytes, k, x, rows, y, ldy, n0, n1); break;
    case WeightKind::Q8_0: gemv_kind<WeightKind::Q8_0>(w, row_bytes, k, x, rows, y, ldy, n0, n1); break;
    case WeightKind::F32: break;
  }
}

}  // namespace

const Kernels& avx512_kernels() {
  static const Kernels table = [] {
    Kernels t = avx2_kernels();
    t.name = "avx512vnni";
    t.gemv_quant = gemv_quant;
    return t;
  }();
  return table;
}

}  // namespace deepinfer::cpu

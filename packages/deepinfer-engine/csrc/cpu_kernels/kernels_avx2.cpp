// AVX2 + FMA + F16C kernels (x86-64). This file alone is compiled with -mavx2 -mfma -mf16c and is
// only called after best_kernels() found those features at run time; it uses no inline functions
// or templates shared with other files (a shared one could be linked in its AVX2 form and run
// on a CPU without AVX2).
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <type_traits>

#include "cpu_kernels/kernels.h"

namespace deepinfer::cpu {
namespace {

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 32 nibbles of a Q4 block in ggml's layout as bytes 0..15, in element order (low halves, then high halves).
inline __m256i nibbles(const uint8_t* p) {
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i b = _mm256_insertf128_si256(_mm256_castsi128_si256(t), _mm_srli_epi16(t, 4), 1);
  return _mm256_and_si256(b, _mm256_set1_epi8(0x0F));
}

// Sum of the 32 products of unsigned bytes u and signed bytes s, as 8 float partial sums.
inline __m256 dot_u8_s8(__m256i u, __m256i s) {
  const __m256i p16 = _mm256_maddubs_epi16(u, s);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
}

// 0x10 in byte j where bit j of the block's 32 fifth bits is set: byte j of the broadcast word
// (shuffled so bytes 8c..8c+7 hold its byte c) masked with 1 << (j % 8).
inline __m256i fifth_bits(const uint8_t* qh_bytes) {
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, 4);
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(qh)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

constexpr int kChunk = 64;  // blocks whose scale products are kept on the stack at once

// R activation rows against one regrouped weight row of nb blocks. Per chunk of blocks, the
// products of weight and activation scales (and the offset terms of Q4_0/Q4_1) are computed 8
// at a time; the block loop then does only the integer dot and one FMA. Two accumulators per
// row (even and odd blocks) hide the FMA latency when R is small.
template <int R, WeightKind K>
void row_dots(const uint8_t* row, int nb, int k, const Acts& x, float* y, int ldy) {
  constexpr size_t cb = code_bytes(K);
  const uint8_t* d_half = row + static_cast<size_t>(nb) * cb;
  const uint8_t* m_half = d_half + 2 * static_cast<size_t>(nb);
  __m256 acc[R][2], off[R];
  float off_tail[R];
  alignas(32) float ds[R][kChunk];
  for (int r = 0; r < R; ++r) {
    acc[r][0] = acc[r][1] = off[r] = _mm256_setzero_ps();
    off_tail[r] = 0.0f;
  }
  for (int c0 = 0; c0 < nb; c0 += kChunk) {
    const int c1 = nb < c0 + kChunk ? nb : c0 + kChunk;
    int i = c0;
    for (; i + 8 <= c1; i += 8) {
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d_half + 2 * i)));
      __m256 mw = _mm256_setzero_ps();
      if constexpr (K == WeightKind::Q4_1) mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m_half + 2 * i)));
      if constexpr (K == WeightKind::Q4_0) mw = _mm256_mul_ps(dw, _mm256_set1_ps(-8.0f));
      if constexpr (K == WeightKind::Q5_0) mw = _mm256_mul_ps(dw, _mm256_set1_ps(-16.0f));
      for (int r = 0; r < R; ++r) {
        const size_t at = static_cast<size_t>(r) * nb + i;
        _mm256_store_ps(ds[r] + (i - c0), _mm256_mul_ps(dw, _mm256_loadu_ps(x.d + at)));
        if constexpr (K != WeightKind::Q8_0) off[r] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(x.s + at), off[r]);
      }
    }
    for (; i < c1; ++i) {
      const float dw = half_at(d_half + 2 * i);
      const float mw = K == WeightKind::Q4_1 ? half_at(m_half + 2 * i) : K == WeightKind::Q5_0 ? -16.0f * dw : -8.0f * dw;
      for (int r = 0; r < R; ++r) {
        const size_t at = static_cast<size_t>(r) * nb + i;
        ds[r][i - c0] = dw * x.d[at];
        if constexpr (K != WeightKind::Q8_0) off_tail[r] += mw * x.s[at];
      }
    }
    for (i = c0; i < c1; ++i) {
      const uint8_t* codes = row + static_cast<size_t>(i) * cb;
      __m256i wq;
      if constexpr (K == WeightKind::Q8_0) {
        wq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes));
      } else if ((nb & 1) && i == nb - 1) {
        wq = nibbles(codes);  // odd last block: ggml's layout
      } else {  // a pair of blocks: this one's codes are the low (even i) or high nibbles
        const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + static_cast<size_t>(i & ~1) * cb));
        wq = _mm256_and_si256(i & 1 ? _mm256_srli_epi16(t, 4) : t, _mm256_set1_epi8(0x0F));
      }
      if constexpr (K == WeightKind::Q5_0) wq = _mm256_or_si256(wq, fifth_bits(m_half + 4 * static_cast<size_t>(i)));
      const __m256i wabs = K == WeightKind::Q8_0 ? _mm256_sign_epi8(wq, wq) : wq;
      for (int r = 0; r < R; ++r) {
        __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.qs + static_cast<size_t>(r) * k + i * kBlock));
        if constexpr (K == WeightKind::Q8_0) xq = _mm256_sign_epi8(xq, wq);
        acc[r][i & 1] = _mm256_fmadd_ps(_mm256_broadcast_ss(&ds[r][i - c0]), dot_u8_s8(wabs, xq), acc[r][i & 1]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    y[static_cast<size_t>(r) * ldy] = hsum(_mm256_add_ps(acc[r][0], acc[r][1])) + hsum(off[r]) + off_tail[r];
}

// Weight rows [n0, n1) against the activation rows in tiles of up to 8:
// dots(std::integral_constant<int, R>, row, nb, k, tile's Acts, y of the tile's first row).
// The weight codes are unpacked once per tile, which is most of a small model's decode cost on
// two cores: a speculative verify step of 1 + k rows (k <= 7) unpacks each weight row once, as a
// decode row does (tiles of 4 cost a 5-row step about 1.6x a 4-row one). A row's arithmetic does
// not depend on the tile it is in (batch invariance).
template <class Dots>
void gemv_tiles(const uint8_t* w, size_t row_bytes, int k, const Acts& x, int rows, float* y, int ldy, int n0, int n1,
                Dots dots) {
  const int nb = k / kBlock;
  for (int n = n0; n < n1; ++n) {
    const uint8_t* row = w + static_cast<size_t>(n) * row_bytes;
    for (int b = 0; b < rows;) {
      const Acts xb{x.qs + static_cast<size_t>(b) * k, x.d + static_cast<size_t>(b) * nb, x.s + static_cast<size_t>(b) * nb};
      float* yb = y + static_cast<size_t>(b) * ldy + n;
      switch (rows - b) {
        case 1: dots(std::integral_constant<int, 1>{}, row, nb, k, xb, yb); b += 1; break;
        case 2: dots(std::integral_constant<int, 2>{}, row, nb, k, xb, yb); b += 2; break;
        case 3: dots(std::integral_constant<int, 3>{}, row, nb, k, xb, yb); b += 3; break;
        case 4: dots(std::integral_constant<int, 4>{}, row, nb, k, xb, yb); b += 4; break;
        case 5: dots(std::integral_constant<int, 5>{}, row, nb, k, xb, yb); b += 5; break;
        case 6: dots(std::integral_constant<int, 6>{}, row, nb, k, xb, yb); b += 6; break;
        case 7: dots(std::integral_constant<int, 7>{}, row, nb, k, xb, yb); b += 7; break;
        default: dots(std::integral_constant<int, 8>{}, row, nb, k, xb, yb); b += 8; break;
      }
    }
  }
}

template <WeightKind K>
void gemv_kind(const uint8_t* w, size_t row_bytes, int k, const Acts& x, int rows, float* y, int ldy, int n0, int n1) {
  gemv_tiles(w, row_bytes, k, x, rows, y, ldy, n0, n1, [ldy](auto r, const uint8_t* row, int nb, int kk, const Acts& xb, float* yb) {
    row_dots<decltype(r)::value, K>(row, nb, kk, xb, yb, ldy);
  });
}

// ---- K-quants (ggml's super-block layout as stored, see kernels.h) ----------------------------

// Scales and mins (6 bits each) of the 8 sub-blocks of a Q4_K/Q5_K super-block's 12 scale bytes.
inline void scales_mins_k4(const uint8_t* q, int* sc, int* m) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = q[j] & 63;
    m[j] = q[j + 4] & 63;
    sc[j + 4] = (q[j + 8] & 0x0F) | ((q[j] >> 6) << 4);
    m[j + 4] = (q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4);
  }
}

inline __m256i shift_right16(__m256i v, int n) { return _mm256_srl_epi16(v, _mm_cvtsi32_si128(n)); }

// R activation rows against one K-quant weight row of nsb super-blocks. Per sub-block of 32 the
// weight codes are unpacked once for the R rows. Q4_K/Q5_K: codes unsigned (maddubs against the
// signed activations), one FMA of d sc_j xd_i per row, the mins through the activation block sums.
// Q6_K: codes - 32 signed (|w| times x with w's sign), the two 16-weight halves weighted by their
// int8 scales in one madd, one FMA of d xd_i per row.
template <int R, WeightKind K>
void row_dots_k(const uint8_t* row, int nsb, int k, const Acts& x, float* y, int ldy) {
  constexpr size_t bb = block_bytes(K);
  const int nb = k / kBlock;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 acc[R];
  float off[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    off[r] = 0.0f;
  }
  for (int s = 0; s < nsb; ++s) {
    const uint8_t* blk = row + static_cast<size_t>(s) * bb;
    if constexpr (K == WeightKind::Q6_K) {
      const float d = half_at(blk + 208);
      const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
      for (int j = 0; j < 8; ++j) {
        const int h = j / 4, u = j % 4, i = 8 * s + j;
        const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32 * (u & 1)));
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
        const __m256i lo = _mm256_and_si256(shift_right16(ql, 4 * (u >> 1)), low4);
        const __m256i hi = _mm256_and_si256(_mm256_slli_epi16(shift_right16(qh, 2 * u), 4), _mm256_set1_epi8(0x30));
        const __m256i wq = _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32));
        const __m256i wabs = _mm256_sign_epi8(wq, wq);
        const __m256i scales = _mm256_set_m128i(_mm_set1_epi16(sc[2 * j + 1]), _mm_set1_epi16(sc[2 * j]));
        for (int r = 0; r < R; ++r) {
          const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.qs + static_cast<size_t>(r) * k + i * kBlock));
          const __m256i p16 = _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(xq, wq));
          const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, scales));
          acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * x.d[static_cast<size_t>(r) * nb + i]), p, acc[r]);
        }
      }
    } else {
      const float d = half_at(blk), dmin = half_at(blk + 2);
      int sc[8], m[8];
      scales_mins_k4(blk + 4, sc, m);
      const uint8_t* qs = blk + (K == WeightKind::Q5_K ? 48 : 16);
      __m256i qh = _mm256_setzero_si256();
      if constexpr (K == WeightKind::Q5_K) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16));
      for (int j = 0; j < 8; ++j) {
        const int i = 8 * s + j;
        const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * (j / 2)));
        __m256i wq = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(t, 4) : t, low4);
        if constexpr (K == WeightKind::Q5_K) {
          const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << j));
          const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
          wq = _mm256_or_si256(wq, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
        }
        const float ds = d * static_cast<float>(sc[j]), dm = dmin * static_cast<float>(m[j]);
        for (int r = 0; r < R; ++r) {
          const size_t at = static_cast<size_t>(r) * nb + i;
          const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.qs + static_cast<size_t>(r) * k + i * kBlock));
          acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(ds * x.d[at]), dot_u8_s8(wq, xq), acc[r]);
          off[r] -= dm * x.s[at];
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) y[static_cast<size_t>(r) * ldy] = hsum(acc[r]) + off[r];
}

template <WeightKind K>
void gemv_k(const uint8_t* w, size_t row_bytes, int k, const Acts& x, int rows, float* y, int ldy, int n0, int n1) {
  gemv_tiles(w, row_bytes, k, x, rows, y, ldy, n0, n1, [ldy](auto r, const uint8_t* row, int, int kk, const Acts& xb, float* yb) {
    row_dots_k<decltype(r)::value, K>(row, kk / kSuper, kk, xb, yb, ldy);
  });
}

void gemv_quant(WeightKind kind, const uint8_t* w, size_t row_bytes, int k, const Acts& x, int rows,
                float* y, int ldy, int n0, int n1) {
  switch (kind) {
    case WeightKind::Q4_K: gemv_k<WeightKind::Q4_K>(w, row_bytes, k, x, rows, y, ldy, n0, n1); break;
    case WeightKind::Q5_K: gemv_k<WeightKind::Q5_K>(w, row_bytes, k, x, rows, y, ldy, n0, n1); break;
    case WeightKind::Q6_K: gemv_k<WeightKind::Q6_K>(w, row_bytes, k, x, rows, y, ldy, n0, n1); break;
    case WeightKind::Q5_0: gemv_kind<WeightKind::Q5_0>(w, row_bytes, k, x, rows, y, ldy, n0, n1); break;
    case WeightKind::Q4_0: gemv_kind<WeightKind::Q4_0>(w, row_bytes, k, x, rows, y, ldy, n0, n1); break;
    case WeightKind::Q4_1: gemv_kind<WeightKind::Q4_1>(w, row_bytes, k, x, rows, y, ldy, n0, n1); break;
    case WeightKind::Q8_0: gemv_kind<WeightKind::Q8_0>(w, row_bytes, k, x, rows, y, ldy, n0, n1); break;
    case WeightKind::F32: break;
  }
}

// F32: R activation rows against one weight row, 16 floats a step (two accumulators per row).
template <int R>
void row_dots_f32(const float* w, int k, const float* x, float* y, int ldy) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  int i = 0;
  for (; i + 16 <= k; i += 16) {
    // 4 KiB ahead: the next rows, across the page boundary where the hardware prefetcher stops
    // (a prefetch never faults, also past the end of the weight)
    _mm_prefetch(reinterpret_cast<const char*>(w + i + 1024), _MM_HINT_T0);
    const __m256 w0 = _mm256_loadu_ps(w + i), w1 = _mm256_loadu_ps(w + i + 8);
    for (int r = 0; r < R; ++r) {
      const float* xr = x + static_cast<size_t>(r) * k + i;
      acc[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float s = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
    const float* xr = x + static_cast<size_t>(r) * k;
    for (int j = i; j < k; ++j) s += w[j] * xr[j];
    y[static_cast<size_t>(r) * ldy] = s;
  }
}

void gemv_f32(const float* w, int k, const float* x, int rows, float* y, int ldy, int n0, int n1) {
  for (int n = n0; n < n1; ++n) {
    const float* row = w + static_cast<size_t>(n) * k;
    int b = 0;
    for (; b + 4 <= rows; b += 4) row_dots_f32<4>(row, k, x + static_cast<size_t>(b) * k, y + static_cast<size_t>(b) * ldy + n, ldy);
    switch (rows - b) {
      case 3: row_dots_f32<3>(row, k, x + static_cast<size_t>(b) * k, y + static_cast<size_t>(b) * ldy + n, ldy); break;
      case 2: row_dots_f32<2>(row, k, x + static_cast<size_t>(b) * k, y + static_cast<size_t>(b) * ldy + n, ldy); break;
      case 1: row_dots_f32<1>(row, k, x + static_cast<size_t>(b) * k, y + static_cast<size_t>(b) * ldy + n, ldy); break;
      default: break;
    }
  }
}

float dot(const float* a, const float* b, int n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  float s = hsum(_mm256_add_ps(acc0, acc1));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

void axpy(float a, const float* x, float* y, int n) {
  const __m256 va = _mm256_set1_ps(a);
  int i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += a * x[i];
}

// The generic table's quantize_row, 8 lanes at a time and bitwise the same: d = max|x| / 127 per
// block of 32, codes nearbyint(x / d) (round half to even, as _mm256_round_ps), their sum. A block
// with a NaN or an infinity goes through the generic function (which makes its scale NaN).
void quantize_row(const float* x, int k, int8_t* qs, float* d_out, float* s_out) {
  const __m256 sign = _mm256_set1_ps(-0.0f), zero = _mm256_setzero_ps();
  const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  for (int i = 0; i < k / 32; ++i) {
    const float* v = x + static_cast<size_t>(i) * 32;
    __m256 a[4];
    __m256 finite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    for (int j = 0; j < 4; ++j) {
      a[j] = _mm256_loadu_ps(v + 8 * j);
      finite = _mm256_and_ps(finite, _mm256_cmp_ps(_mm256_sub_ps(a[j], a[j]), zero, _CMP_EQ_OQ));
    }
    if (_mm256_movemask_ps(finite) != 0xFF) {
      generic_kernels().quantize_row(v, 32, qs + static_cast<size_t>(i) * 32, d_out + i, s_out + i);
      continue;
    }
    const __m256 m8 = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, a[0]), _mm256_andnot_ps(sign, a[1])),
                                    _mm256_max_ps(_mm256_andnot_ps(sign, a[2]), _mm256_andnot_ps(sign, a[3])));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float d = _mm_cvtss_f32(m4) / 127.0f;
    const __m256 id = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
    __m256i q[4];
    __m256i sum = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      const __m256 r = _mm256_round_ps(_mm256_mul_ps(a[j], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m256 in_range = _mm256_and_ps(_mm256_cmp_ps(r, lo, _CMP_GE_OQ), _mm256_cmp_ps(r, hi, _CMP_LE_OQ));
      q[j] = _mm256_cvtps_epi32(_mm256_and_ps(r, in_range));  // out of range: 0, as the generic one
      sum = _mm256_add_epi32(sum, q[j]);
    }
    // int32 -> int8 in element order (the packs work per 128-bit lane; the permute puts lanes back)
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qs + static_cast<size_t>(i) * 32),
                        _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    d_out[i] = d;
    s_out[i] = d * static_cast<float>(_mm_cvtsi128_si32(s4));
  }
}

// The cache slots of tokens 0, 1, 2, ... of a sequence, without a division per token.
struct TokenWalk {
  const int64_t* table;
  int block_size;
  int offset = 0;
  size_t next() {
    const size_t slot = static_cast<size_t>(*table) * block_size + offset;
    if (++offset == block_size) {
      offset = 0;
      ++table;
    }
    return slot;
  }
};

// e^x for 8 floats: 2^n * p(r) with x = n ln2 + r, the degree-6 polynomial of the AVX-512
// table's exp16 (relative error ~2e-7); 0 below -87 (e^x < 2^-125), e^88 (~1.7e38) above 88
// instead of infinity, NaN stays NaN.
inline __m256 exp8(__m256 x) {
  const __m256 lowest = _mm256_set1_ps(-87.0f);
  const __m256 tiny = _mm256_cmp_ps(x, lowest, _CMP_LT_OQ);
  // a NaN x (the second operand of each) passes through
  x = _mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(lowest, x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  // 2^n as float bits: n is in [-126, 127] here, a normal exponent
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(two_n)));
}

// The 8 sums of s[0..7] as one vector (lane u = the sum of s[u]'s lanes): a transposing tree.
inline __m256 sums8(const __m256* s) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(s[0], s[1]), _mm256_hadd_ps(s[2], s[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(s[4], s[5]), _mm256_hadd_ps(s[6], s[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// out = silu(gate) * up = gate / (1 + e^-gate) * up, 8 at a time (the rest as the generic one).
void silu_mul(const float* gate, const float* up, float* out, int n) {
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = exp8(_mm256_xor_ps(g, sign));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
  }
  if (i < n) generic_kernels().silu_mul(gate + i, up + i, out + i, n - i);
}

// Lanes below n set (0 <= n <= 8).
inline __m256i first_lanes(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// Scores of one query against a tile of nl <= 8 tokens (k rows kt[0..nl)) into dst[0..nl): the
// 8 dot products q . k_u (q scaled, C vectors) summed by one transposing reduction.
template <int C>
inline void score_tile(const __m256* qv, const float* const* kt, int nl, float* dst) {
  __m256 s[8];
  for (int u = 0; u < 8; ++u) {
    if (u >= nl) {
      s[u] = _mm256_setzero_ps();
      continue;
    }
    s[u] = _mm256_mul_ps(qv[0], _mm256_loadu_ps(kt[u]));
    for (int c = 1; c < C; ++c) s[u] = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(kt[u] + 8 * c), s[u]);
  }
  const __m256 sc = sums8(s);
  if (nl == 8) {
    _mm256_storeu_ps(dst, sc);
  } else {
    _mm256_maskstore_ps(dst, first_lanes(nl), sc);
  }
}

// scores[0..len) -> e^(score - max), in place, 8 at a time; returns their sum (the softmax
// denominator). The maximum is taken lane-wise over the 8-token tiles, then across the lanes.
inline float exp_scores(float* scores, int len) {
  __m256 vmax = _mm256_set1_ps(-INFINITY);
  for (int t0 = 0; t0 < len; t0 += 8) {
    if (len - t0 >= 8) {
      vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(scores + t0));
    } else {
      const __m256i live = first_lanes(len - t0);
      vmax = _mm256_blendv_ps(vmax, _mm256_max_ps(vmax, _mm256_maskload_ps(scores + t0, live)),
                              _mm256_castsi256_ps(live));
    }
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const __m256 vm = _mm256_set1_ps(_mm_cvtss_f32(m4));
  __m256 sum = _mm256_setzero_ps();
  int t = 0;
  for (; t + 8 <= len; t += 8) {
    const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + t), vm));
    _mm256_storeu_ps(scores + t, p);
    sum = _mm256_add_ps(sum, p);
  }
  if (t < len) {
    const __m256i live = first_lanes(len - t);
    const __m256 p = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_maskload_ps(scores + t, live), vm)),
                                   _mm256_castsi256_ps(live));
    _mm256_maskstore_ps(scores + t, live, p);
    sum = _mm256_add_ps(sum, p);
  }
  return hsum(sum);
}

// One head with d = 8 C, as the AVX-512 table's attend_regs: q scaled once; scores 8 tokens at a
// time (score_tile), then their exponentials 8 at a time (exp_scores), then the weighted sum of the
// values with the output in registers. No function call or division per token.
template <int C>
void attend_regs(const float* q, const float* k, const float* v, size_t stride, const int64_t* table, int block_size,
                 int len, float scale, float* scores, float* out) {
  __m256 qv[C];
  for (int c = 0; c < C; ++c) qv[c] = _mm256_mul_ps(_mm256_loadu_ps(q + 8 * c), _mm256_set1_ps(scale));
  TokenWalk kw{table, block_size};
  for (int t0 = 0; t0 < len; t0 += 8) {
    const int n = len - t0 < 8 ? len - t0 : 8;
    const float* kt[8];
    for (int u = 0; u < n; ++u) kt[u] = k + kw.next() * stride;
    score_tile<C>(qv, kt, n, scores + t0);
  }
  const float total = exp_scores(scores, len);
  __m256 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
  TokenWalk vw{table, block_size};
  for (int u = 0; u < len; ++u) {
    const float* vt = v + vw.next() * stride;
    const __m256 p = _mm256_set1_ps(scores[u]);
    for (int c = 0; c < C; ++c) acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vt + 8 * c), acc[c]);
  }
  const __m256 inv = _mm256_set1_ps(1.0f / total);
  for (int c = 0; c < C; ++c) _mm256_storeu_ps(out + 8 * c, _mm256_mul_ps(acc[c], inv));
}

// attend_regs for n queries of one kv head at once, bitwise attend_regs' result for each (the same
// operations in the same order per query): 8-token tiles whose k rows (then v rows) are loaded from
// the cache once and read from L1 by every query (the heads of a GQA group, and the rows of a
// speculative verify step, which differ only in how many tokens they see). Each query's scaled q,
// scores and accumulator go through `work` instead of registers, which changes no value.
template <int C>
void attend_many_regs(const float* const* qs, float* const* outs, const int* lens, int n, const float* k,
                      const float* v, size_t stride, const int64_t* table, int block_size, float scale, float* work) {
  constexpr int D = 8 * C;
  int max_len = 0;
  for (int i = 0; i < n; ++i) max_len = lens[i] > max_len ? lens[i] : max_len;
  const size_t ss = (static_cast<size_t>(max_len) + 7) / 8 * 8;  // a query's row of scores
  float* qsc = work + static_cast<size_t>(n) * ss;                // scaled queries [n, D]
  float* totals = qsc + static_cast<size_t>(n) * D;                // softmax denominators [n]
  for (int i = 0; i < n; ++i)
    for (int c = 0; c < C; ++c)
      _mm256_storeu_ps(qsc + i * D + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(qs[i] + 8 * c), _mm256_set1_ps(scale)));
  TokenWalk kw{table, block_size};
  for (int t0 = 0; t0 < max_len; t0 += 8) {
    const int nt = max_len - t0 < 8 ? max_len - t0 : 8;
    const float* kt[8];
    for (int u = 0; u < nt; ++u) kt[u] = k + kw.next() * stride;
    for (int i = 0; i < n; ++i) {
      const int nl = lens[i] - t0 < nt ? lens[i] - t0 : nt;
      if (nl <= 0) continue;
      __m256 qv[C];  // the query in registers for the tile (one load per weight of q, as attend_regs)
      for (int c = 0; c < C; ++c) qv[c] = _mm256_loadu_ps(qsc + i * D + 8 * c);
      score_tile<C>(qv, kt, nl, work + i * ss + t0);
    }
  }
  for (int i = 0; i < n; ++i) {  // each query's exponentials, as attend_regs takes them
    totals[i] = exp_scores(work + i * ss, lens[i]);
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(outs[i] + 8 * c, _mm256_setzero_ps());
  }
  TokenWalk vw{table, block_size};
  for (int t0 = 0; t0 < max_len; t0 += 8) {
    const int nt = max_len - t0 < 8 ? max_len - t0 : 8;
    const float* vt[8];
    for (int u = 0; u < nt; ++u) vt[u] = v + vw.next() * stride;
    for (int i = 0; i < n; ++i) {
      const int nl = lens[i] - t0 < nt ? lens[i] - t0 : nt;
      if (nl <= 0) continue;
      const float* pi = work + i * ss + t0;
      __m256 acc[C];
      for (int c = 0; c < C; ++c) acc[c] = _mm256_loadu_ps(outs[i] + 8 * c);
      for (int u = 0; u < nl; ++u) {
        const __m256 p = _mm256_set1_ps(pi[u]);
        for (int c = 0; c < C; ++c) acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vt[u] + 8 * c), acc[c]);
      }
      for (int c = 0; c < C; ++c) _mm256_storeu_ps(outs[i] + 8 * c, acc[c]);
    }
  }
  for (int i = 0; i < n; ++i) {
    const __m256 inv = _mm256_set1_ps(1.0f / totals[i]);
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(outs[i] + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(outs[i] + 8 * c), inv));
  }
}

void attend_many(const float* const* qs, float* const* outs, const int* lens, int n, int d, const float* k,
                 const float* v, size_t stride, const int64_t* table, int block_size, float scale, float* work);

void attend(const float* q, int d, const float* k, const float* v, size_t stride, const int64_t* table,
            int block_size, int len, float scale, float* scores, float* out) {
  switch (d) {
    case 16: attend_regs<2>(q, k, v, stride, table, block_size, len, scale, scores, out); return;
    case 32: attend_regs<4>(q, k, v, stride, table, block_size, len, scale, scores, out); return;
    case 64: attend_regs<8>(q, k, v, stride, table, block_size, len, scale, scores, out); return;
    case 128: attend_regs<16>(q, k, v, stride, table, block_size, len, scale, scores, out); return;
    default: attend_with(dot, axpy, q, d, k, v, stride, table, block_size, len, scale, scores, out);
  }
}

void attend_many(const float* const* qs, float* const* outs, const int* lens, int n, int d, const float* k,
                 const float* v, size_t stride, const int64_t* table, int block_size, float scale, float* work) {
  if (n == 1) {  // nothing to share: the register kernel (bitwise the same)
    attend(qs[0], d, k, v, stride, table, block_size, lens[0], scale, work, outs[0]);
    return;
  }
  switch (d) {
    case 16: attend_many_regs<2>(qs, outs, lens, n, k, v, stride, table, block_size, scale, work); return;
    case 32: attend_many_regs<4>(qs, outs, lens, n, k, v, stride, table, block_size, scale, work); return;
    case 64: attend_many_regs<8>(qs, outs, lens, n, k, v, stride, table, block_size, scale, work); return;
    case 128: attend_many_regs<16>(qs, outs, lens, n, k, v, stride, table, block_size, scale, work); return;
    default: attend_each(attend, qs, outs, lens, n, d, k, v, stride, table, block_size, scale, work);
  }
}

}  // namespace

const Kernels& avx2_kernels() {
  // quantize_row: bitwise the generic one (the tables quantize activations alike).
  static const Kernels table{"avx2", gemv_quant, gemv_f32, quantize_row, dot, axpy,
                             silu_mul, attend, attend_many};
  return table;
}

}  // namespace deepinfer::cpu

// AVX-512 kernels (x86-64 with AVX512F/BW/VL/VNNI). Like kernels_avx2.cpp, this file alone is
// built for its instruction set, only called after best_kernels() found it at run time, and
// shares no inline functions or templates with other files.
//
// GEMVs over several activation rows work on tiles of weight rows x activation rows: each
// weight vector loaded (and, for Q4, unpacked) once serves the tile's activation rows, and a step
// over 16 rows reads every weight once while its tile sits in L1. The quantized tile takes two
// blocks per 512-bit integer dot (vpdpbusd). One activation row: small quantized tiles, and
// float32 rows read as one sequential stream (f32_single). Quantized tiles (act_tile): 2 weight
// rows x up to 6 activation rows (a 5- or 6-row step in one tile, not 4 + 1 / 4 + 2; 7 and more
// in tiles of 4, as 2 x 8 would spill), Q5_0 steps of 8+ rows 1 weight row x up to 8 (its code
// unpacking is the costliest, shared by 8 rows). Several rows cost about the same per row in any
// tile (per (weight row, activation row) and block pair: the dot, a scale permute, a conversion
// and an FMA), so the shapes only trim the shared work. A row's arithmetic does not depend on
// the tile (batch invariance): every (weight row, activation row) is summed alike in each.
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "cpu_kernels/kernels.h"

namespace deepinfer::cpu {
namespace {

// Tile sizes (measured on this Zen 5 VM, one and two threads): float32 activation rows per tile
// (quantized ones: act_tile); quantized weight rows per tile for one activation row (Q4: 2,
// Q8_0: 1 -- more rows are more concurrent streams and registers, and were slower) and for
// several (more would spill the accumulators); float32 weight rows for several activation rows
// (one row: f32_single).
constexpr int kActTile = 4;
constexpr int kQ4Tile1 = 2, kQ8Tile1 = 1, kQuantTileN = 2;
constexpr int kQ5Rows1 = 8;  // Q5_0 steps of this many rows or more: tiles of 1 weight row x up to 8
constexpr int kF32Tile = 4;
constexpr int kGroup = 8;  // blocks whose scales convert and multiply together

// permutexvar indices: lanes 0-7 take scale 2p of a group, lanes 8-15 scale 2p + 1
alignas(64) constexpr int32_t kPairIndex[kGroup / 2][16] = {
    {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1},
    {2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3},
    {4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5},
    {6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7},
};

// The 64 codes of blocks i, i + 1 (regrouped layout, see kernels.h) in element order. Q4: the
// pair's 32 bytes in both halves, masked to the low nibbles in the lower half and to the high
// nibbles in the upper one -- block i + 1's codes times 16 (no shift; its scale carries the 1/16).
// Q5_0: the low nibbles in the lower half, the high ones shifted down in the upper half (a fifth
// bit times 16 would not fit a byte), then the pair's 64 fifth bits (one 64-bit load of the
// regrouped bits) as 0x10 bytes.
template <WeightKind K>
inline __m512i pair_codes(const uint8_t* row, int nb, size_t i) {
  const uint8_t* codes = row + i * code_bytes(K);
  if constexpr (K == WeightKind::Q8_0) {
    return _mm512_loadu_si512(codes);
  } else if constexpr (K == WeightKind::Q5_0) {
    const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes));
    const __m512i lo_hi = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(t), _mm256_srli_epi16(t, 4), 1),
                                           _mm512_set1_epi8(0x0F));
    uint64_t bits;
    std::memcpy(&bits, row + static_cast<size_t>(nb) * 18 + 4 * i, 8);
    return _mm512_or_si512(lo_hi, _mm512_and_si512(_mm512_movm_epi8(bits), _mm512_set1_epi8(0x10)));
  } else {
    const __m512i b = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes)));
    return _mm512_and_si512(b, _mm512_inserti64x4(_mm512_set1_epi8(0x0F), _mm256_set1_epi8(static_cast<char>(0xF0)), 1));
  }
}

// Per block of a group: 1, or 1/16 for the second block of a Q4 pair (its codes come times 16).
template <WeightKind K>
inline __m256 pair_code_scale() {
  if constexpr (K == WeightKind::Q8_0 || K == WeightKind::Q5_0) {
    return _mm256_set1_ps(1.0f);
  } else {
    return _mm256_setr_ps(1.0f, 0.0625f, 1.0f, 0.0625f, 1.0f, 0.0625f, 1.0f, 0.0625f);
  }
}

// The 32 codes of an odd last block (ggml's layout for Q4).
template <WeightKind K>
inline __m256i single_codes(const uint8_t* row, int nb, size_t i) {
  const uint8_t* codes = row + i * code_bytes(K);
  if constexpr (K == WeightKind::Q8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes));
  } else {
    const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
    const __m256i q = _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(t), _mm_srli_epi16(t, 4), 1),
                                       _mm256_set1_epi8(0x0F));
    if constexpr (K != WeightKind::Q5_0) return q;
    uint32_t bits;
    std::memcpy(&bits, row + static_cast<size_t>(nb) * 18 + 4 * i, 4);
    return _mm256_or_si256(q, _mm256_and_si256(_mm256_movm_epi8(bits), _mm256_set1_epi8(0x10)));
  }
}

// NR regrouped weight rows (row_bytes apart) x R activation rows -> y[r * ldy + j].
// Per group of 8 blocks the products of weight and activation scales are formed 8 at a time (and
// the offset terms of Q4_0/Q4_1, added straight into the accumulators); per pair of blocks each
// (weight row, activation row) costs one vpdpbusd, one conversion and one FMA.
template <WeightKind K, int NR, int R>
void quant_tile(const uint8_t* w, size_t row_bytes, int nb, int k, const Acts& x, float* y, int ldy) {
  constexpr size_t cb = code_bytes(K);
  const size_t scales_at = static_cast<size_t>(nb) * cb;
  __m512 acc[NR][R];
  alignas(32) float ds[NR][R][kGroup];
  for (int j = 0; j < NR; ++j)
    for (int r = 0; r < R; ++r) acc[j][r] = _mm512_setzero_ps();
  for (int g = 0; g < nb; g += kGroup) {
    const int count = nb - g < kGroup ? nb - g : kGroup;
    const __mmask8 m8 = static_cast<__mmask8>((1u << count) - 1);
    __m256 dx[R], sx[R];
    for (int r = 0; r < R; ++r) {
      const size_t at = static_cast<size_t>(r) * nb + g;
      dx[r] = _mm256_maskz_loadu_ps(m8, x.d + at);
      if constexpr (K != WeightKind::Q8_0) sx[r] = _mm256_maskz_loadu_ps(m8, x.s + at);
    }
    for (int j = 0; j < NR; ++j) {
      const uint8_t* scales = w + j * row_bytes + scales_at;
      const __m256 dw = _mm256_cvtph_ps(_mm_maskz_loadu_epi16(m8, scales + 2 * g));
      __m256 mw = _mm256_setzero_ps();
      if constexpr (K == WeightKind::Q4_1) mw = _mm256_cvtph_ps(_mm_maskz_loadu_epi16(m8, scales + 2 * (nb + g)));
      if constexpr (K == WeightKind::Q4_0) mw = _mm256_mul_ps(dw, _mm256_set1_ps(-8.0f));
      if constexpr (K == WeightKind::Q5_0) mw = _mm256_mul_ps(dw, _mm256_set1_ps(-16.0f));
      const __m256 dwc = _mm256_mul_ps(dw, pair_code_scale<K>());  // exact: a power of two
      for (int r = 0; r < R; ++r) {
        _mm256_store_ps(ds[j][r], _mm256_mul_ps(dwc, dx[r]));
        if constexpr (K != WeightKind::Q8_0)
          acc[j][r] = _mm512_add_ps(acc[j][r], _mm512_zextps256_ps512(_mm256_mul_ps(mw, sx[r])));
      }
    }
    for (int p = 0; p < count / 2; ++p) {
      const size_t i = static_cast<size_t>(g + 2 * p);
      const __m512i index = _mm512_load_si512(kPairIndex[p]);
      // Q4: codes unsigned, activations signed; each dot starts at 0. Q8_0, both signed:
      // - one activation row: |w| times x with w's sign;
      // - several: the activations go unsigned as x + 128 (xor 0x80) and each dot starts at
      //   -128 * sum(w) (one vpdpbusd per weight vector), no sign transfer per (weight row,
      //   activation row). Both exact.
      constexpr bool q8_offset = K == WeightKind::Q8_0 && R > 1;
      __m512i wv[NR], start[NR];
      __mmask64 neg[NR];
      for (int j = 0; j < NR; ++j) {
        wv[j] = pair_codes<K>(w + j * row_bytes, nb, i);
        start[j] = _mm512_setzero_si512();
        neg[j] = 0;
        if constexpr (q8_offset) {
          start[j] = _mm512_sub_epi32(start[j], _mm512_dpbusd_epi32(start[j], _mm512_set1_epi8(static_cast<char>(0x80)), wv[j]));
        } else if constexpr (K == WeightKind::Q8_0) {
          neg[j] = _mm512_movepi8_mask(wv[j]);
          wv[j] = _mm512_abs_epi8(wv[j]);
        }
      }
      for (int r = 0; r < R; ++r) {
        __m512i xq = _mm512_loadu_si512(x.qs + static_cast<size_t>(r) * k + i * kBlock);
        if constexpr (q8_offset) xq = _mm512_xor_si512(xq, _mm512_set1_epi8(static_cast<char>(0x80)));
        for (int j = 0; j < NR; ++j) {
          __m512i dot;
          if constexpr (q8_offset) {
            dot = _mm512_dpbusd_epi32(start[j], xq, wv[j]);
          } else if constexpr (K == WeightKind::Q8_0) {
            dot = _mm512_dpbusd_epi32(start[j], wv[j], _mm512_mask_sub_epi8(xq, neg[j], _mm512_setzero_si512(), xq));
          } else {
            dot = _mm512_dpbusd_epi32(start[j], wv[j], xq);
          }
          const __m512 scale = _mm512_permutexvar_ps(index, _mm512_castps256_ps512(_mm256_load_ps(ds[j][r])));
          acc[j][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[j][r]);
        }
      }
    }
    if (count & 1) {  // odd block count: the row's last block alone, on 256-bit lanes
      const size_t i = static_cast<size_t>(g + count - 1);
      __m256i wu[NR], wq[NR];
      for (int j = 0; j < NR; ++j) {
        wq[j] = single_codes<K>(w + j * row_bytes, nb, i);
        wu[j] = K == WeightKind::Q8_0 ? _mm256_abs_epi8(wq[j]) : wq[j];
      }
      for (int r = 0; r < R; ++r) {
        const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.qs + static_cast<size_t>(r) * k + i * kBlock));
        for (int j = 0; j < NR; ++j) {
          const __m256i xs = K == WeightKind::Q8_0 ? _mm256_sign_epi8(xq, wq[j]) : xq;
          const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wu[j], xs);
          const __m256 v = _mm256_mul_ps(_mm256_set1_ps(ds[j][r][count - 1]), _mm256_cvtepi32_ps(dot));
          acc[j][r] = _mm512_add_ps(acc[j][r], _mm512_zextps256_ps512(v));
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NR; ++j) y[static_cast<size_t>(r) * ldy + j] = _mm512_reduce_add_ps(acc[j][r]);
}

// Activation rows of the next tile with `left` rows to go. Tiles of NR = 2 weight rows: up to 6
// rows one tile (5 and 6 in one are cheaper than 4 + 1 and 4 + 2: the small tile's shared work
// serves one or two rows), 7 as 4 + 3, more in tiles of 4 (8 in one spills: 16 accumulators and
// the 16 hoisted scale vectors); so 8 = 4 + 4, 9 = 4 + 5, 16 = 4 x 4. Tiles of NR = 1 (Q5_0 steps
// of 8 or more rows): as even as possible, up to 8 (9 = 5 + 4, 16 = 8 + 8).
template <int NR>
inline int act_tile(int left) {
  if constexpr (NR == 1) {
    const int tiles = (left + 7) / 8;
    return (left + tiles - 1) / tiles;
  } else {
    return left <= 6 ? left : 4;
  }
}

template <WeightKind K, int NR>
void quant_rows(const uint8_t* w, size_t row_bytes, int nb, int k, const Acts& x, int rows, float* y, int ldy) {
  for (int b = 0; b < rows;) {
    const Acts xb{x.qs + static_cast<size_t>(b) * k, x.d + static_cast<size_t>(b) * nb, x.s + static_cast<size_t>(b) * nb};
    float* yb = y + static_cast<size_t>(b) * ldy;
    const int r = act_tile<NR>(rows - b);
    b += r;
    switch (r) {
      case 1: quant_tile<K, NR, 1>(w, row_bytes, nb, k, xb, yb, ldy); break;
      case 2: quant_tile<K, NR, 2>(w, row_bytes, nb, k, xb, yb, ldy); break;
      case 3: quant_tile<K, NR, 3>(w, row_bytes, nb, k, xb, yb, ldy); break;
      case 4: quant_tile<K, NR, 4>(w, row_bytes, nb, k, xb, yb, ldy); break;
      case 5: quant_tile<K, NR, 5>(w, row_bytes, nb, k, xb, yb, ldy); break;
      case 6: quant_tile<K, NR, 6>(w, row_bytes, nb, k, xb, yb, ldy); break;
      case 7:  // NR = 1 only: act_tile<2> is at most 6
        if constexpr (NR == 1) quant_tile<K, NR, 7>(w, row_bytes, nb, k, xb, yb, ldy);
        break;
      default:
        if constexpr (NR == 1) quant_tile<K, NR, 8>(w, row_bytes, nb, k, xb, yb, ldy);
        break;
    }
  }
}

template <WeightKind K>
void gemv_kind(const uint8_t* w, size_t row_bytes, int k, const Acts& x, int rows, float* y, int ldy, int n0, int n1) {
  const int nb = k / kBlock;
  static_assert(kQ4Tile1 <= 2 && kQ8Tile1 <= 2 && kQuantTileN <= 2, "gemv_kind instantiates NR = 1 and 2");
  const int tile = rows == 1                                   ? (K == WeightKind::Q8_0 ? kQ8Tile1 : kQ4Tile1)
                   : K == WeightKind::Q5_0 && rows >= kQ5Rows1 ? 1
                                                               : kQuantTileN;
  for (int n = n0; n < n1; n += tile) {
    const uint8_t* wn = w + static_cast<size_t>(n) * row_bytes;
    if (tile == 1 || n1 - n < 2) {
      quant_rows<K, 1>(wn, row_bytes, nb, k, x, rows, y + n, ldy);
    } else {
      quant_rows<K, 2>(wn, row_bytes, nb, k, x, rows, y + n, ldy);
    }
  }
}

void gemv_quant(WeightKind kind, const uint8_t* w, size_t row_bytes, int k, const Acts& x, int rows,
                float* y, int ldy, int n0, int n1) {
  switch (kind) {
    case WeightKind::Q4_0: gemv_kind<WeightKind::Q4_0>(w, row_bytes, k, x, rows, y, ldy, n0, n1); break;
    case WeightKind::Q4_1: gemv_kind<WeightKind::Q4_1>(w, row_bytes, k, x, rows, y, ldy, n0, n1); break;
    case WeightKind::Q8_0: gemv_kind<WeightKind::Q8_0>(w, row_bytes, k, x, rows, y, ldy, n0, n1); break;
    case WeightKind::Q5_0: gemv_kind<WeightKind::Q5_0>(w, row_bytes, k, x, rows, y, ldy, n0, n1); break;
    case WeightKind::Q4_K:
    case WeightKind::Q5_K:
    case WeightKind::Q6_K:
      // the AVX2 K-quant kernels (this table's CPUs all have AVX2); no 512-bit versions yet
      avx2_kernels().gemv_quant(kind, w, row_bytes, k, x, rows, y, ldy, n0, n1);
      break;
    case WeightKind::F32: break;
  }
}

// ---- float32 ---------------------------------------------------------------------------------

// NR weight rows (k apart) x R activation rows, 16 floats a step; the next tile's same position
// is prefetched.
template <int NR, int R>
void f32_tile(const float* w, int k, const float* x, float* y, int ldy) {
  __m512 acc[NR][R];
  for (int j = 0; j < NR; ++j)
    for (int r = 0; r < R; ++r) acc[j][r] = _mm512_setzero_ps();
  const size_t ks = static_cast<size_t>(k);
  int i = 0;
  for (; i + 16 <= k; i += 16) {
    __m512 wv[NR];
    for (int j = 0; j < NR; ++j) {
      // a prefetch never faults, also past the end of the weight
      _mm_prefetch(reinterpret_cast<const char*>(w + (NR + j) * ks + i), _MM_HINT_T0);
      wv[j] = _mm512_loadu_ps(w + j * ks + i);
    }
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * ks + i);
      for (int j = 0; j < NR; ++j) acc[j][r] = _mm512_fmadd_ps(wv[j], xv, acc[j][r]);
    }
  }
  if (i < k) {
    const __mmask16 m = static_cast<__mmask16>((1u << (k - i)) - 1);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_maskz_loadu_ps(m, x + r * ks + i);
      for (int j = 0; j < NR; ++j) acc[j][r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, w + j * ks + i), xv, acc[j][r]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NR; ++j) y[static_cast<size_t>(r) * ldy + j] = _mm512_reduce_add_ps(acc[j][r]);
}

template <int NR>
void f32_rows(const float* w, int k, const float* x, int rows, float* y, int ldy) {
  for (int b = 0; b < rows; b += kActTile) {
    const float* xb = x + static_cast<size_t>(b) * k;
    float* yb = y + static_cast<size_t>(b) * ldy;
    switch (rows - b < kActTile ? rows - b : kActTile) {
      case 1: f32_tile<NR, 1>(w, k, xb, yb, ldy); break;
      case 2: f32_tile<NR, 2>(w, k, xb, yb, ldy); break;
      case 3: f32_tile<NR, 3>(w, k, xb, yb, ldy); break;
      default: f32_tile<NR, 4>(w, k, xb, yb, ldy); break;
    }
  }
}

// One activation row: the weight rows one after another, a single sequential stream (with two
// threads streaming, tiles of several rows -- several streams each -- read ~15 % slower). No
// software prefetch: the hardware prefetcher follows the stream, and a prefetch 1 KiB or 8 KiB
// ahead measured 5-15 % slower at one thread (bench/cpu_native_step.py).
// Batch invariance: each dot is summed exactly as f32_tile sums it (one accumulator, 16 floats a
// step in order, the masked tail last, then one reduction), so a row's outputs are bitwise the
// same alone and in a tile of several rows. (Four accumulators here summed in another order; one
// chain of 4-cycle FMAs still outruns the memory stream, and out-of-order execution overlaps
// consecutive rows' chains.)
void f32_single(const float* w, int k, const float* x, float* y, int n0, int n1) {
  for (int n = n0; n < n1; ++n) {
    const float* wr = w + static_cast<size_t>(n) * k;
    __m512 acc = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 <= k; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(wr + i), _mm512_loadu_ps(x + i), acc);
    if (i < k) {
      const __mmask16 m = static_cast<__mmask16>((1u << (k - i)) - 1);
      acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, wr + i), _mm512_maskz_loadu_ps(m, x + i), acc);
    }
    y[n] = _mm512_reduce_add_ps(acc);
  }
}

void gemv_f32(const float* w, int k, const float* x, int rows, float* y, int ldy, int n0, int n1) {
  if (rows == 1) {
    f32_single(w, k, x, y, n0, n1);
    return;
  }
  for (int n = n0; n < n1; n += kF32Tile) {
    const float* wn = w + static_cast<size_t>(n) * k;
    switch (n1 - n < kF32Tile ? n1 - n : kF32Tile) {
      case 1: f32_rows<1>(wn, k, x, rows, y + n, ldy); break;
      case 2: f32_rows<2>(wn, k, x, rows, y + n, ldy); break;
      case 3: f32_rows<3>(wn, k, x, rows, y + n, ldy); break;
      default: f32_rows<4>(wn, k, x, rows, y + n, ldy); break;
    }
  }
}

// ---- activations, attention, SiLU ------------------------------------------------------------

// 8-bit codes per block of 32, bitwise as the generic quantize_row (same divisions and rounding:
// round-to-nearest-even of x * (1 / d)).
void quantize_row(const float* x, int k, int8_t* qs, float* d_out, float* s_out) {
  const __m512 zero = _mm512_setzero_ps();
  for (int i = 0; i < k / kBlock; ++i) {
    const __m512 v0 = _mm512_loadu_ps(x + i * kBlock), v1 = _mm512_loadu_ps(x + i * kBlock + 16);
    // v - v is 0 for finite v, NaN for NaN and inf
    const bool finite = (_mm512_cmp_ps_mask(_mm512_sub_ps(v0, v0), zero, _CMP_EQ_OQ) &
                         _mm512_cmp_ps_mask(_mm512_sub_ps(v1, v1), zero, _CMP_EQ_OQ)) == 0xFFFF;
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float d = amax / 127.0f;
    const float id = d > 0.0f ? 1.0f / d : 0.0f;
    const __m512 vid = _mm512_set1_ps(id), lim = _mm512_set1_ps(127.0f);
    const __m512 r0 = _mm512_roundscale_ps(_mm512_mul_ps(v0, vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r1 = _mm512_roundscale_ps(_mm512_mul_ps(v1, vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    // |r| <= 127 (false for NaN): else 0, as the generic kernel
    const __mmask16 ok0 = _mm512_cmp_ps_mask(_mm512_abs_ps(r0), lim, _CMP_LE_OQ);
    const __mmask16 ok1 = _mm512_cmp_ps_mask(_mm512_abs_ps(r1), lim, _CMP_LE_OQ);
    const __m512i q0 = _mm512_maskz_cvtps_epi32(ok0, r0), q1 = _mm512_maskz_cvtps_epi32(ok1, r1);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qs + i * kBlock), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qs + i * kBlock + 16), _mm512_cvtsepi32_epi8(q1));
    const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    d_out[i] = finite ? d : NAN;
    s_out[i] = finite ? d * static_cast<float>(sum) : NAN;
  }
}

// e^x for 16 floats: 2^n * p(r) with x = n ln2 + r, |r| <= ln2 / 2, p a degree-6 polynomial
// (relative error ~2e-7 over the float range; underflows to 0 below -87.3, inf above 88.7).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-103.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

void silu_mul(const float* gate, const float* up, float* out, int n) {
  int i = 0;
  for (; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 g = _mm512_maskz_loadu_ps(m, gate + i), u = _mm512_maskz_loadu_ps(m, up + i);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(s, u));
  }
}

float dot(const float* a, const float* b, int n) {
  __m512 acc = _mm512_setzero_ps();
  for (int i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

void axpy(float a, const float* x, float* y, int n) {
  const __m512 va = _mm512_set1_ps(a);
  for (int i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(y + i, m, _mm512_fmadd_ps(va, _mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i)));
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

// The 16 sums of s[0..15] as one vector (lane u = sum of s[u]): a transposing tree of 15 adds.
inline __m512 sums16(const __m512* s) {
  __m512 t[8], u[4], v[2];
  for (int i = 0; i < 8; ++i)
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(s[2 * i], s[2 * i + 1]), _mm512_unpackhi_ps(s[2 * i], s[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44), _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; ++i)
    v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88), _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], 0x88), _mm512_shuffle_f32x4(v[0], v[1], 0xDD));
}

// One head with d = 16 C: q and the output stay in registers; scores 16 tokens at a time (one
// transposing reduction for the 16 dots), then their exponentials, then the weighted sum of the
// values.
template <int C>
void attend_regs(const float* q, const float* k, const float* v, size_t stride, const int64_t* table, int block_size,
                 int len, float scale, float* scores, float* out) {
  __m512 qv[C], acc[C];
  for (int c = 0; c < C; ++c) {
    qv[c] = _mm512_mul_ps(_mm512_loadu_ps(q + 16 * c), _mm512_set1_ps(scale));
    acc[c] = _mm512_setzero_ps();
  }
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  TokenWalk kw{table, block_size};
  for (int t0 = 0; t0 < len; t0 += 16) {
    const int n = len - t0 < 16 ? len - t0 : 16;
    __m512 s[16];
    for (int u = 0; u < 16; ++u) {
      if (u >= n) {
        s[u] = _mm512_setzero_ps();
        continue;
      }
      const float* kt = k + kw.next() * stride;
      s[u] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kt));
      for (int c = 1; c < C; ++c) s[u] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kt + 16 * c), s[u]);
    }
    const __mmask16 mk = static_cast<__mmask16>((1u << n) - 1);
    const __m512 sc = sums16(s);
    _mm512_mask_storeu_ps(scores + t0, mk, sc);
    vmax = _mm512_mask_max_ps(vmax, mk, vmax, sc);
  }
  __m512 sum = _mm512_setzero_ps();
  const __m512 vm = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
  for (int t = 0; t < len; t += 16) {
    const __mmask16 mk = len - t >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (len - t)) - 1);
    const __m512 p = _mm512_maskz_mov_ps(mk, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, scores + t), vm)));
    _mm512_mask_storeu_ps(scores + t, mk, p);
    sum = _mm512_add_ps(sum, p);
  }
  TokenWalk vw{table, block_size};
  for (int t = 0; t < len; ++t) {
    const float* vt = v + vw.next() * stride;
    const __m512 p = _mm512_set1_ps(scores[t]);
    for (int c = 0; c < C; ++c) acc[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vt + 16 * c), acc[c]);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
  for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + 16 * c, _mm512_mul_ps(acc[c], inv));
}

void attend(const float* q, int d, const float* k, const float* v, size_t stride, const int64_t* table,
            int block_size, int len, float scale, float* scores, float* out) {
  switch (d) {
    case 16: attend_regs<1>(q, k, v, stride, table, block_size, len, scale, scores, out); return;
    case 32: attend_regs<2>(q, k, v, stride, table, block_size, len, scale, scores, out); return;
    case 64: attend_regs<4>(q, k, v, stride, table, block_size, len, scale, scores, out); return;
    case 128: attend_regs<8>(q, k, v, stride, table, block_size, len, scale, scores, out); return;
    default: attend_with(dot, axpy, q, d, k, v, stride, table, block_size, len, scale, scores, out);
  }
}

void attend_many(const float* const* qs, float* const* outs, const int* lens, int n, int d, const float* k,
                 const float* v, size_t stride, const int64_t* table, int block_size, float scale, float* work) {
  attend_each(attend, qs, outs, lens, n, d, k, v, stride, table, block_size, scale, work);
}

}  // namespace

const Kernels& avx512_kernels() {
  static const Kernels table{"avx512vnni", gemv_quant, gemv_f32, quantize_row, dot, axpy, silu_mul, attend,
                             attend_many, repack_row};
  return table;
}

}  // namespace deepinfer::cpu

// AVX-512 kernels (x86-64 with AVX512F/BW/VL/VNNI). Like kernels_avx2.cpp, this file alone is
// built for its instruction set, only called after best_kernels() found it at run time, and
// shares no inline functions or templates with other files.
//
// Quantized weights (Q4_0, Q4_1, Q5_0, Q8_0 and the K-quants) are interleaved by groups of 16 rows
// at registration (see "groups of 16 interleaved weight rows" below): one 512-bit integer dot
// (vpdpbusd) multiplies 4 codes of each of 16 rows by 4 activation codes broadcast, so a block of
// 32 costs per activation row 8 dots, a conversion, a multiply and an FMA for 16 rows, and no
// horizontal sum is left at the end. Rows after a weight's last whole group keep the per-row
// layout (K-quants: ggml's, on the AVX2 kernels) and the tiles of weight rows x activation rows
// below: each weight vector loaded (and, for Q4, unpacked) once serves the tile's activation rows,
// two blocks per 512-bit dot. Their tiles (act_tile): 2 weight rows x up to 6 activation rows (7 and more in tiles of 4),
// Q5_0 steps of 8+ rows 1 weight row x up to 8. A row's arithmetic does not depend on the tile or
// on how many activation rows share the call (batch invariance): every (weight row, activation
// row) is summed alike in each.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_kernels/kernels.h"

#define DI_INLINE_LAMBDA __attribute__((always_inline))

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
    const Acts xb = acts_from_row(x, b, k);
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
void gemv_rows(const uint8_t* w, size_t row_bytes, int k, const Acts& x, int rows, float* y, int ldy, int n0, int n1) {
  const int nb = k / kBlock;
  static_assert(kQ4Tile1 <= 2 && kQ8Tile1 <= 2 && kQuantTileN <= 2, "gemv_rows instantiates NR = 1 and 2");
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

// ---- groups of 16 interleaved weight rows (Q4_0, Q4_1, Q5_0, Q8_0; the K-quants further down) ---
//
// A weight's whole groups of kRowGroup rows are stored block by block: block b of group g (16
// blocks of ggml, one per row, the same bytes) is
//   codes: Q4: 4 vectors of 64 bytes, vector u lane l = bytes 4u..4u+3 of row l's 16 nibble bytes
//          (low nibbles: codes 4u..4u+3, high nibbles: codes 16+4u..16+4u+3);
//          Q8_0: 8 vectors, vector t lane l = codes 4t..4t+3 of row l, stored + 128 (unsigned);
//   16 fp16 d (row l's), then Q4_1: 16 fp16 m; Q5_0: 8 masks of 64 bits, bit 4l + i of mask t =
//   the fifth bit of code 4t + i of row l.
// Unpacked, dot vector t (t < 8) holds in lane l the codes 4t..4t+3 of row l (Q4: t < 4 the low
// nibbles of vector t, t >= 4 the high ones of vector t - 4), so one vpdpbusd against an
// activation row's 4 codes broadcast adds 4 products to each of 16 rows, 8 finish a block, and
// a block costs per activation row 8 dots, a conversion, a multiply and an FMA for 16 rows
// (the tiles above: 4 ops per row and pair of blocks, 64 per 16 rows and block). The code offsets
// (Q4_0 8, Q5_0 16, Q8_0 128) leave the integer dot exactly through the activations' code sums,
// Q4_1's minimums go in through s. Rows after the last whole group keep the per-row layout and
// the tiles above.
constexpr int kRowGroup = 16;

// The weight bytes [p + kAhead, p + kAhead + bytes) into L1, one line at a time: 4 KiB ahead of
// the block being read, across the page boundary where the hardware prefetcher stops (a prefetch
// never faults, also past the end of the weight).
constexpr size_t kAhead = 4096;
inline void prefetch_ahead(const uint8_t* p, size_t bytes) {
  for (size_t o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + kAhead + o), _MM_HINT_T0);
}

// 4 activation codes (one 32-bit word) in every lane: an embedded-broadcast operand of vpdpbusd.
inline __m512i broadcast4(const int8_t* p) {
  int32_t four;
  std::memcpy(&four, p, 4);
  return _mm512_set1_epi32(four);
}

// One activation row's 32 codes xq against a block's 8 dot vectors: codes 0-15 into h0, 16-31 into
// h1 (two chains of 4 dots; integer sums, exact in any order).
inline __attribute__((always_inline)) void dots8(const __m512i* wv, const int8_t* xq, __m512i& h0, __m512i& h1) {
  for (int t = 0; t < 4; ++t) {
    h0 = _mm512_dpbusd_epi32(h0, wv[t], broadcast4(xq + 4 * t));
    h1 = _mm512_dpbusd_epi32(h1, wv[t + 4], broadcast4(xq + 16 + 4 * t));
  }
}

constexpr int kGroupActTile = 8;  // activation rows per group tile (8 accumulators, 8 code vectors)

// The code offset taken out of the integer dot (w = (q - offset) d).
template <WeightKind K>
constexpr int code_offset() {
  return K == WeightKind::Q4_0 ? 8 : K == WeightKind::Q5_0 ? 16 : K == WeightKind::Q8_0 ? 128 : 0;
}

void repack_group(WeightKind kind, const uint8_t* src, size_t row_bytes, int nb, uint8_t* dst) {
  const size_t bb = block_bytes(kind);
  const size_t cb = kind == WeightKind::Q8_0 ? 512 : 256;  // codes of a block of 16 rows
  for (int b = 0; b < nb; ++b) {
    uint8_t* out = dst + static_cast<size_t>(b) * kRowGroup * bb;
    uint64_t masks[8] = {};
    for (int l = 0; l < kRowGroup; ++l) {
      const uint8_t* blk = src + static_cast<size_t>(l) * row_bytes + static_cast<size_t>(b) * bb;
      std::memcpy(out + cb + 2 * l, blk, 2);  // d
      if (kind == WeightKind::Q8_0) {
        for (int t = 0; t < 8; ++t) {
          uint32_t four;
          std::memcpy(&four, blk + 2 + 4 * t, 4);
          four ^= 0x80808080u;  // + 128 in each byte
          std::memcpy(out + 64 * t + 4 * l, &four, 4);
        }
        continue;
      }
      // after d: Q4_1's m, Q5_0's qh
      const uint8_t* qs = blk + (kind == WeightKind::Q4_0 ? 2 : kind == WeightKind::Q4_1 ? 4 : 6);
      for (int u = 0; u < 4; ++u) std::memcpy(out + 64 * u + 4 * l, qs + 4 * u, 4);
      if (kind == WeightKind::Q4_1) std::memcpy(out + cb + 32 + 2 * l, blk + 2, 2);
      if (kind == WeightKind::Q5_0) {
        uint32_t qh;
        std::memcpy(&qh, blk + 2, 4);
        for (int t = 0; t < 8; ++t) masks[t] |= static_cast<uint64_t>((qh >> (4 * t)) & 0xF) << (4 * l);
      }
    }
    if (kind == WeightKind::Q5_0) std::memcpy(out + cb + 32, masks, sizeof(masks));
  }
}

// ---- K-quants by groups of 16 rows ------------------------------------------------------------
//
// Super-block s of a group (16 ggml super-blocks, one per row, the same bytes; sub-block j of
// super-block s multiplies activation block 8 s + j):
//   Q4_K (2304 bytes): codes: per pair p < 4 of sub-blocks, 8 vectors of 64 bytes, vector u lane l
//        = bytes 4u..4u+3 of row l's 32 nibble bytes of the pair (low nibbles: codes 4u..4u+3 of
//        sub-block 2p; high: of 2p + 1); then the rows' 12 scale bytes as 3 vectors (vector v lane
//        l = scale bytes 4v..4v+3 of row l: ggml's 6-bit packing, unpacked for 16 rows at once);
//        16 fp16 d; 16 fp16 dmin.
//   Q5_K (2816): as Q4_K, with 64 masks of 64 bits after the codes: bit 4l + i of mask 8j + t =
//        the fifth bit of code 4t + i of sub-block j of row l.
//   Q6_K (3360): low nibbles as Q4_K's codes, ggml's 32-byte chunk P holding sub-blocks
//        4(P / 2) + P % 2 (low) and that + 2 (high); high 2-bit pairs: per 32-byte chunk n < 2
//        of ggml's, 8 vectors, vector u lane l = bytes 4u..4u+3 of row l's chunk (bits 2U: sub-block
//        4n + U); the int8 scales, 32 bytes per sub-block j (its two 16-weight halves for the 16
//        rows); 16 fp16 d.
// Per sub-block and activation row: 8 dots, a conversion and an FMA (Q4_K/Q5_K: and the mins'
// FMA; Q6_K: its two halves' dots start at -32 times their code sums and are weighted by their
// int8 scales in integers, exactly).
constexpr size_t kCodesK = 2048;  // codes (Q6_K: low nibbles) of a super-block of 16 rows

void repack_group_k(WeightKind kind, const uint8_t* src, size_t row_bytes, int nsb, uint8_t* dst) {
  const size_t bb = block_bytes(kind);
  for (int sb = 0; sb < nsb; ++sb) {
    uint8_t* out = dst + static_cast<size_t>(sb) * kRowGroup * bb;
    uint64_t masks[64] = {};  // Q5_K: mask 8j + t
    for (int l = 0; l < kRowGroup; ++l) {
      const uint8_t* blk = src + static_cast<size_t>(l) * row_bytes + static_cast<size_t>(sb) * bb;
      if (kind == WeightKind::Q6_K) {
        for (int P = 0; P < 4; ++P)
          for (int u = 0; u < 8; ++u) std::memcpy(out + 512 * P + 64 * u + 4 * l, blk + 32 * P + 4 * u, 4);
        for (int n = 0; n < 2; ++n)
          for (int u = 0; u < 8; ++u) std::memcpy(out + kCodesK + 512 * n + 64 * u + 4 * l, blk + 128 + 32 * n + 4 * u, 4);
        for (int j = 0; j < 8; ++j)
          for (int h = 0; h < 2; ++h) out[kCodesK + 1024 + 32 * j + 16 * h + l] = blk[192 + 2 * j + h];
        std::memcpy(out + kCodesK + 1280 + 2 * l, blk + 208, 2);
        continue;
      }
      const uint8_t* qs = blk + (kind == WeightKind::Q5_K ? 48 : 16);
      for (int p = 0; p < 4; ++p)
        for (int u = 0; u < 8; ++u) std::memcpy(out + 512 * p + 64 * u + 4 * l, qs + 32 * p + 4 * u, 4);
      size_t at = kCodesK;
      if (kind == WeightKind::Q5_K) {
        const uint8_t* qh = blk + 16;
        for (int j = 0; j < 8; ++j)
          for (int t = 0; t < 8; ++t)
            for (int i = 0; i < 4; ++i) masks[8 * j + t] |= static_cast<uint64_t>((qh[4 * t + i] >> j) & 1) << (4 * l + i);
        at += sizeof(masks);
      }
      for (int v = 0; v < 3; ++v) std::memcpy(out + at + 64 * v + 4 * l, blk + 4 + 4 * v, 4);
      std::memcpy(out + at + 192 + 2 * l, blk, 2);       // d
      std::memcpy(out + at + 224 + 2 * l, blk + 2, 2);   // dmin
    }
    if (kind == WeightKind::Q5_K) std::memcpy(out + kCodesK, masks, sizeof(masks));
  }
}

void repack(WeightKind kind, const uint8_t* src, size_t row_bytes, int rows, int nb, uint8_t* dst) {
  const int whole = rows / kRowGroup * kRowGroup;
  for (int g = 0; g < whole; g += kRowGroup) {
    uint8_t* out = dst + static_cast<size_t>(g) * row_bytes;
    if (k_quant(kind)) {
      repack_group_k(kind, src + static_cast<size_t>(g) * row_bytes, row_bytes, nb, out);
    } else {
      repack_group(kind, src + static_cast<size_t>(g) * row_bytes, row_bytes, nb, out);
    }
  }
  repack_each(repack_row, kind, src + static_cast<size_t>(whole) * row_bytes, row_bytes, rows - whole, nb,
              dst + static_cast<size_t>(whole) * row_bytes);
}

// One group of 16 weight rows (g: its first block) x R activation rows -> y[r * ldy + l], l < 16.
template <WeightKind K, int R>
void group_tile(const uint8_t* g, int nb, int k, const Acts& x, float* y, int ldy) {
  constexpr size_t gb = kRowGroup * block_bytes(K);
  constexpr size_t cb = K == WeightKind::Q8_0 ? 512 : 256;
  constexpr int offset = code_offset<K>();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    const uint8_t* blk = g + static_cast<size_t>(b) * gb;
    prefetch_ahead(blk, gb);
    __m512i wv[8];
    if constexpr (K == WeightKind::Q8_0) {
      for (int t = 0; t < 8; ++t) wv[t] = _mm512_loadu_si512(blk + 64 * t);
    } else {
      for (int u = 0; u < 4; ++u) {
        const __m512i v = _mm512_loadu_si512(blk + 64 * u);
        wv[u] = _mm512_and_si512(v, low4);
        wv[u + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      }
      if constexpr (K == WeightKind::Q5_0) {
        for (int t = 0; t < 8; ++t) {
          uint64_t bits;
          std::memcpy(&bits, blk + cb + 32 + 8 * t, 8);
          wv[t] = _mm512_mask_add_epi8(wv[t], _cvtu64_mask64(bits), wv[t], _mm512_set1_epi8(0x10));
        }
      }
    }
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + cb)));
    __m512 mw = _mm512_setzero_ps();
    if constexpr (K == WeightKind::Q4_1)
      mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + cb + 32)));
    for (int r = 0; r < R; ++r) {
      const size_t at = static_cast<size_t>(r) * nb + b;
      const int8_t* xq = x.qs + static_cast<size_t>(r) * k + static_cast<size_t>(b) * kBlock;
      // the first chain starts from the code offset
      __m512i dot = offset ? _mm512_set1_epi32(-offset * (x.sum[2 * at] + x.sum[2 * at + 1])) : _mm512_setzero_si512();
      __m512i dot1 = _mm512_setzero_si512();
      dots8(wv, xq, dot, dot1);
      dot = _mm512_add_epi32(dot, dot1);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, _mm512_set1_ps(x.d[at])), acc[r]);
      if constexpr (K == WeightKind::Q4_1) acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(x.s[at]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + static_cast<size_t>(r) * ldy, acc[r]);
}

// f(integral_constant<int, j>) for the 8 sub-blocks j of a super-block (compile-time shifts and offsets).
template <typename F>
inline __attribute__((always_inline)) void each_sub_block(F&& f) {
  [&]<int... J>(std::integer_sequence<int, J...>) { (f(std::integral_constant<int, J>{}), ...); }(
      std::make_integer_sequence<int, 8>{});
}

// One group of 16 K-quant weight rows (g: its first super-block) x R activation rows -> y[r * ldy + l].
template <WeightKind K, int R>
void group_tile_k(const uint8_t* g, int nsb, int k, const Acts& x, float* y, int ldy) {
  constexpr size_t gb = kRowGroup * block_bytes(K);
  const int nb = k / kBlock;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  // R activation rows against sub-block j's 8 dot vectors (K-quant codes, unsigned)
  auto rows_dot = [&](int i, const __m512i* wv, __m512 dsc, __m512 dmn, __m512i sc0, __m512i sc1) DI_INLINE_LAMBDA {
    for (int r = 0; r < R; ++r) {
      const size_t at = static_cast<size_t>(r) * nb + i;
      const int8_t* xq = x.qs + static_cast<size_t>(r) * k + static_cast<size_t>(i) * kBlock;
      // Q6_K: each 16-weight half's chain starts from its code offset
      __m512i h0 = _mm512_setzero_si512(), h1 = _mm512_setzero_si512();
      if constexpr (K == WeightKind::Q6_K) {
        h0 = _mm512_set1_epi32(-32 * x.sum[2 * at]);
        h1 = _mm512_set1_epi32(-32 * x.sum[2 * at + 1]);
      }
      dots8(wv, xq, h0, h1);
      __m512i dot;
      if constexpr (K == WeightKind::Q6_K) {
        dot = _mm512_add_epi32(_mm512_mullo_epi32(h0, sc0), _mm512_mullo_epi32(h1, sc1));
      } else {
        dot = _mm512_add_epi32(h0, h1);
      }
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dsc, _mm512_set1_ps(x.d[at])), acc[r]);
      if constexpr (K != WeightKind::Q6_K) acc[r] = _mm512_fnmadd_ps(dmn, _mm512_set1_ps(x.s[at]), acc[r]);
    }
  };
  for (int sb = 0; sb < nsb; ++sb) {
    const uint8_t* blk = g + static_cast<size_t>(sb) * gb;
    const int i0 = 8 * sb;
    __m512i wv[8];
    if constexpr (K == WeightKind::Q6_K) {
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + kCodesK + 1280)));
      each_sub_block([&](auto jc) DI_INLINE_LAMBDA {
        constexpr int j = decltype(jc)::value, n = j / 4, U = j % 4, P = 2 * n + (U & 1);
        prefetch_ahead(blk + j * gb / 8, gb / 8);  // an eighth a sub-block: a few misses in flight at a time
        for (int t = 0; t < 8; ++t) {
          const __m512i lo = _mm512_loadu_si512(blk + 512 * P + 64 * t);
          const __m512i hi = _mm512_loadu_si512(blk + kCodesK + 512 * n + 64 * t);
          __m512i nib = lo, top;
          if constexpr (U >= 2) nib = _mm512_srli_epi16(lo, 4);
          nib = _mm512_and_si512(nib, low4);
          // bits 2U, 2U + 1 of each byte -> bits 4, 5 (a 16-bit shift, then the byte mask)
          if constexpr (U < 2) {
            top = _mm512_slli_epi16(hi, 4 - 2 * U);
          } else if constexpr (U == 2) {
            top = hi;
          } else {
            top = _mm512_srli_epi16(hi, 2);
          }
          wv[t] = _mm512_ternarylogic_epi32(nib, top, _mm512_set1_epi8(0x30), 0xF8);  // nib | (top & 0x30)
        }
        const uint8_t* sc = blk + kCodesK + 1024 + 32 * j;
        const __m512i sc0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
        const __m512i sc1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 16)));
        rows_dot(i0 + j, wv, d, d, sc0, sc1);
      });
    } else {
      constexpr size_t at = kCodesK + (K == WeightKind::Q5_K ? 512 : 0);
      const __m512i a = _mm512_loadu_si512(blk + at), b = _mm512_loadu_si512(blk + at + 64);
      const __m512i c = _mm512_loadu_si512(blk + at + 128);
      const __m512i low6 = _mm512_set1_epi8(0x3F), top2 = _mm512_set1_epi8(0x03);
      // ggml's 6-bit scales and mins, 4 sub-blocks a 32-bit lane (byte j % 4), for the 16 rows
      const __m512i sc_lo = _mm512_and_si512(a, low6), m_lo = _mm512_and_si512(b, low6);
      const __m512i sc_hi = _mm512_or_si512(_mm512_and_si512(c, low4),
                                            _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(a, 6), top2), 4));
      const __m512i m_hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(c, 4), low4),
                                           _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(b, 6), top2), 4));
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + at + 192)));
      const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + at + 224)));
      const __m512i byte = _mm512_set1_epi32(0xFF);
      each_sub_block([&](auto jc) DI_INLINE_LAMBDA {
        constexpr int j = decltype(jc)::value, p = j / 2;
        prefetch_ahead(blk + j * gb / 8, gb / 8);
        for (int t = 0; t < 8; ++t) {
          __m512i v = _mm512_loadu_si512(blk + 512 * p + 64 * t);
          if constexpr (j & 1) v = _mm512_srli_epi16(v, 4);
          wv[t] = _mm512_and_si512(v, low4);
          if constexpr (K == WeightKind::Q5_K) {
            uint64_t bits;
            std::memcpy(&bits, blk + kCodesK + 64 * j + 8 * t, 8);
            wv[t] = _mm512_mask_add_epi8(wv[t], _cvtu64_mask64(bits), wv[t], _mm512_set1_epi8(0x10));
          }
        }
        constexpr int shift = 8 * (j % 4);
        const __m512i scj = _mm512_and_si512(_mm512_srli_epi32(j < 4 ? sc_lo : sc_hi, shift), byte);
        const __m512i mj = _mm512_and_si512(_mm512_srli_epi32(j < 4 ? m_lo : m_hi, shift), byte);
        rows_dot(i0 + j, wv, _mm512_mul_ps(d, _mm512_cvtepi32_ps(scj)), _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(mj)),
                 byte, byte);
      });
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + static_cast<size_t>(r) * ldy, acc[r]);
}

template <WeightKind K, int R>
void any_group_tile(const uint8_t* g, int k, const Acts& x, float* y, int ldy) {
  if constexpr (k_quant(K)) {
    group_tile_k<K, R>(g, k / kSuper, k, x, y, ldy);
  } else {
    group_tile<K, R>(g, k / kBlock, k, x, y, ldy);
  }
}

// One group x all activation rows, in tiles of up to kGroupActTile rows as even as possible.
template <WeightKind K>
void group_rows(const uint8_t* g, int k, const Acts& x, int rows, float* y, int ldy) {
  const int tiles = (rows + kGroupActTile - 1) / kGroupActTile;
  for (int t = 0, b = 0; t < tiles; ++t) {
    const int r = (rows - b + tiles - t - 1) / (tiles - t);  // 9 = 5 + 4, 16 = 8 + 8
    const Acts xb = acts_from_row(x, b, k);
    float* yb = y + static_cast<size_t>(b) * ldy;
    switch (r) {
      case 1: any_group_tile<K, 1>(g, k, xb, yb, ldy); break;
      case 2: any_group_tile<K, 2>(g, k, xb, yb, ldy); break;
      case 3: any_group_tile<K, 3>(g, k, xb, yb, ldy); break;
      case 4: any_group_tile<K, 4>(g, k, xb, yb, ldy); break;
      case 5: any_group_tile<K, 5>(g, k, xb, yb, ldy); break;
      case 6: any_group_tile<K, 6>(g, k, xb, yb, ldy); break;
      case 7: any_group_tile<K, 7>(g, k, xb, yb, ldy); break;
      default: any_group_tile<K, 8>(g, k, xb, yb, ldy); break;
    }
    b += r;
  }
}

template <WeightKind K>
void gemv_kind(const uint8_t* w, size_t row_bytes, int n_rows, int k, const Acts& x, int rows, float* y, int ldy,
               int n0, int n1) {
  const int whole = n_rows / kRowGroup * kRowGroup;
  std::vector<float> part;  // a group cut by [n0, n1): computed whole, the wanted rows copied
  for (int n = n0; n < std::min(n1, whole);) {
    const int g0 = n / kRowGroup * kRowGroup;
    const uint8_t* g = w + static_cast<size_t>(g0) * row_bytes;
    const int take = std::min(n1, g0 + kRowGroup) - n;
    if (n == g0 && take == kRowGroup) {
      group_rows<K>(g, k, x, rows, y + g0, ldy);
    } else {
      part.resize(static_cast<size_t>(rows) * kRowGroup);
      group_rows<K>(g, k, x, rows, part.data(), kRowGroup);
      for (int r = 0; r < rows; ++r)
        std::memcpy(y + static_cast<size_t>(r) * ldy + n, part.data() + static_cast<size_t>(r) * kRowGroup + (n - g0),
                    sizeof(float) * static_cast<size_t>(take));
    }
    n += take;
  }
  if (n1 <= whole) return;
  if constexpr (k_quant(K)) {  // rows after the last group: ggml's layout, the AVX2 kernels
    avx2_kernels().gemv_quant(K, w, row_bytes, n_rows, k, x, rows, y, ldy, std::max(n0, whole), n1);
  } else {
    gemv_rows<K>(w, row_bytes, k, x, rows, y, ldy, std::max(n0, whole), n1);
  }
}

void gemv_quant(WeightKind kind, const uint8_t* w, size_t row_bytes, int n_rows, int k, const Acts& x, int rows,
                float* y, int ldy, int n0, int n1) {
  switch (kind) {
    case WeightKind::Q4_0: gemv_kind<WeightKind::Q4_0>(w, row_bytes, n_rows, k, x, rows, y, ldy, n0, n1); break;
    case WeightKind::Q4_1: gemv_kind<WeightKind::Q4_1>(w, row_bytes, n_rows, k, x, rows, y, ldy, n0, n1); break;
    case WeightKind::Q8_0: gemv_kind<WeightKind::Q8_0>(w, row_bytes, n_rows, k, x, rows, y, ldy, n0, n1); break;
    case WeightKind::Q5_0: gemv_kind<WeightKind::Q5_0>(w, row_bytes, n_rows, k, x, rows, y, ldy, n0, n1); break;
    case WeightKind::Q4_K: gemv_kind<WeightKind::Q4_K>(w, row_bytes, n_rows, k, x, rows, y, ldy, n0, n1); break;
    case WeightKind::Q5_K: gemv_kind<WeightKind::Q5_K>(w, row_bytes, n_rows, k, x, rows, y, ldy, n0, n1); break;
    case WeightKind::Q6_K: gemv_kind<WeightKind::Q6_K>(w, row_bytes, n_rows, k, x, rows, y, ldy, n0, n1); break;
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
                             attend_many, repack};
  return table;
}

}  // namespace deepinfer::cpu

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

// The GEMV's helpers are inlined into each tile (a call per block would cost more than the block).
#define DI_INLINE inline __attribute__((always_inline))
#define DI_INLINE_LAMBDA __attribute__((always_inline))

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
DI_INLINE __m256i nibbles(const uint8_t* p) {
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i b = _mm256_insertf128_si256(_mm256_castsi128_si256(t), _mm_srli_epi16(t, 4), 1);
  return _mm256_and_si256(b, _mm256_set1_epi8(0x0F));
}

// Sum of the 32 products of unsigned bytes u and signed bytes s, as 8 float partial sums.
DI_INLINE __m256 dot_u8_s8(__m256i u, __m256i s) {
  const __m256i p16 = _mm256_maddubs_epi16(u, s);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
}

// 0x10 in byte j where bit j of the block's 32 fifth bits is set: byte j of the broadcast word
// (shuffled so bytes 8c..8c+7 hold its byte c) masked with 1 << (j % 8).
DI_INLINE __m256i fifth_bits(const uint8_t* qh_bytes) {
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, 4);
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(qh)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

// Lanes below n set (0 <= n <= 8).
DI_INLINE __m256i first_lanes(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

constexpr int kChunk = 64;  // blocks whose scale products are kept on the stack at once (a multiple of 8)
constexpr int kTile = 4;    // activation rows whose accumulators stay in registers

// Codes of block i of a regrouped row as unsigned bytes (Q8_0: its signed codes), for blocks after
// the row's last whole group of 8 (Q5_0: the fifth bits from the block's 4 bytes).
template <WeightKind K>
DI_INLINE __m256i block_codes(const uint8_t* row, int nb, int i) {
  constexpr size_t cb = code_bytes(K);
  if constexpr (K == WeightKind::Q8_0) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + static_cast<size_t>(i) * cb));
  __m256i wq;
  if ((nb & 1) && i == nb - 1) {
    wq = nibbles(row + static_cast<size_t>(i) * cb);  // odd last block: ggml's layout
  } else {  // a pair of blocks: this one's codes are the low (even i) or high nibbles
    const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + static_cast<size_t>(i & ~1) * cb));
    wq = _mm256_and_si256(i & 1 ? _mm256_srli_epi16(t, 4) : t, _mm256_set1_epi8(0x0F));
  }
  if constexpr (K == WeightKind::Q5_0)
    wq = _mm256_or_si256(wq, fifth_bits(row + static_cast<size_t>(nb) * (cb + 2) + 4 * static_cast<size_t>(i)));
  return wq;
}

// The fifth bits of the whole group of blocks g..g+7 (Q5_0: its 32 bytes of bit planes).
template <WeightKind K>
DI_INLINE __m256i group_planes(const uint8_t* row, int nb, int g) {
  if constexpr (K != WeightKind::Q5_0) return _mm256_setzero_si256();
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + static_cast<size_t>(nb) * (code_bytes(K) + 2) +
                                                            4 * static_cast<size_t>(g)));
}

// Codes of blocks g + J and g + J + 1 (J even) of a whole group of 8 (as block_codes; planes:
// group_planes): a Q4 pair's 32 bytes, Q5_0's fifth bits J and J + 1 of each byte moved to 0x10.
template <WeightKind K, int J>
DI_INLINE void pair_codes(const uint8_t* row, int g, __m256i planes, __m256i& w0, __m256i& w1) {
  constexpr size_t cb = code_bytes(K);
  const uint8_t* codes = row + static_cast<size_t>(g + J) * cb;
  if constexpr (K == WeightKind::Q8_0) {
    w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes));
    w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + cb));
    return;
  }
  const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes));
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  w0 = _mm256_and_si256(t, low4);
  w1 = _mm256_and_si256(_mm256_srli_epi16(t, 4), low4);
  if constexpr (K == WeightKind::Q5_0) {
    const __m256i bit4 = _mm256_set1_epi8(0x10);
    __m256i b0, b1;
    if constexpr (J < 4) {
      b0 = _mm256_slli_epi16(planes, 4 - J);
      b1 = _mm256_slli_epi16(planes, 3 - J);
    } else if constexpr (J == 4) {
      b0 = planes;
      b1 = _mm256_srli_epi16(planes, 1);
    } else {
      b0 = _mm256_srli_epi16(planes, J - 4);
      b1 = _mm256_srli_epi16(planes, J - 3);
    }
    w0 = _mm256_or_si256(w0, _mm256_and_si256(b0, bit4));
    w1 = _mm256_or_si256(w1, _mm256_and_si256(b1, bit4));
  }
}

// Weight scales d and offset factors (Q4_0: -8 d, Q5_0: -16 d, Q4_1: m, Q8_0: 0) of blocks i..i+7
// of a regrouped row; lanes past the row's nb blocks are 0.
template <WeightKind K>
DI_INLINE void block_scales(const uint8_t* row, int nb, int i, __m256& dw, __m256& mw) {
  const uint8_t* d_half = row + static_cast<size_t>(nb) * code_bytes(K);
  const uint8_t* m_half = d_half + 2 * static_cast<size_t>(nb);
  __m128i dh, mh = _mm_setzero_si128();
  if (i + 8 <= nb) {
    dh = _mm_loadu_si128(reinterpret_cast<const __m128i*>(d_half + 2 * i));
    if constexpr (K == WeightKind::Q4_1) mh = _mm_loadu_si128(reinterpret_cast<const __m128i*>(m_half + 2 * i));
  } else {
    alignas(16) uint16_t h[2][8] = {};
    std::memcpy(h[0], d_half + 2 * i, 2 * static_cast<size_t>(nb - i));
    if constexpr (K == WeightKind::Q4_1) std::memcpy(h[1], m_half + 2 * i, 2 * static_cast<size_t>(nb - i));
    dh = _mm_load_si128(reinterpret_cast<const __m128i*>(h[0]));
    mh = _mm_load_si128(reinterpret_cast<const __m128i*>(h[1]));
  }
  dw = _mm256_cvtph_ps(dh);
  mw = _mm256_setzero_ps();
  if constexpr (K == WeightKind::Q4_1) mw = _mm256_cvtph_ps(mh);
  if constexpr (K == WeightKind::Q4_0) mw = _mm256_mul_ps(dw, _mm256_set1_ps(-8.0f));
  if constexpr (K == WeightKind::Q5_0) mw = _mm256_mul_ps(dw, _mm256_set1_ps(-16.0f));
}

// A row's running sums over a weight row: the products of even and odd blocks, the offset terms
// of the whole groups of 8 blocks (a lane each) and those of the blocks after them.
struct RowSums {
  __m256 acc[2], off;
  float off_tail;
};

// Scale and offset factor of one block after the last whole group (block_scales' values).
template <WeightKind K>
DI_INLINE void tail_scales(const uint8_t* row, int nb, int i, float& dw, float& mw) {
  const uint8_t* d_half = row + static_cast<size_t>(nb) * code_bytes(K);
  dw = half_at(d_half + 2 * static_cast<size_t>(i));
  mw = K == WeightKind::Q4_1   ? half_at(d_half + 2 * static_cast<size_t>(nb) + 2 * static_cast<size_t>(i))
       : K == WeightKind::Q5_0 ? -16.0f * dw
       : K == WeightKind::Q4_0 ? -8.0f * dw
                               : 0.0f;
}

// The scale products ds[r][i - c0] = d_i * x.d (weight and activation block scales) of blocks
// [c0, c1) for R activation rows, 8 at a time over the whole groups of 8 blocks, whose offset
// terms (Q4_0/Q4_1/Q5_0) go into sums[r].off a lane each; those of the blocks after them into
// sums[r].off_tail, one FMA each. Every tile adds a row's terms so, in this order.
template <int R, WeightKind K>
DI_INLINE void scale_products(const uint8_t* row, int nb, int c0, int c1, const Acts& x, float (*ds)[kChunk],
                              RowSums* sums) {
  int i = c0;
  for (; i + 8 <= c1; i += 8) {
    __m256 dw, mw;
    block_scales<K>(row, nb, i, dw, mw);
    for (int r = 0; r < R; ++r) {
      const size_t at = static_cast<size_t>(r) * nb + i;
      _mm256_store_ps(ds[r] + (i - c0), _mm256_mul_ps(dw, _mm256_loadu_ps(x.d + at)));
      if constexpr (K != WeightKind::Q8_0) sums[r].off = _mm256_fmadd_ps(mw, _mm256_loadu_ps(x.s + at), sums[r].off);
    }
  }
  for (; i < c1; ++i) {
    float dw, mw;
    tail_scales<K>(row, nb, i, dw, mw);
    for (int r = 0; r < R; ++r) {
      const size_t at = static_cast<size_t>(r) * nb + i;
      ds[r][i - c0] = dw * x.d[at];
      if constexpr (K != WeightKind::Q8_0)
        sums[r].off_tail = _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(mw), _mm_set_ss(x.s[at]), _mm_set_ss(sums[r].off_tail)));
    }
  }
}

// R activation rows (R <= kTile) against blocks [c0, c1) of one weight row (c0 a multiple of
// kChunk). The products of weight and activation scales (ds) are formed 8 blocks at a time for
// the chunk first (stored well before the block loop reads them one float at a time: a load just
// after a wider store to it stalls on store forwarding), with the offset terms of the whole groups
// (Q4_0/Q4_1/Q5_0); a block then costs its integer dot and one FMA per row, into one of two
// accumulators (even and odd blocks; the pairs are written out so that they stay in registers).
// The codes are unpacked in registers per pair of blocks. A row's operations and their order
// depend neither on R nor on the other rows (batch invariance), and are row_dots' (the tiles of
// more rows).
template <int R, WeightKind K>
DI_INLINE void tile_blocks(const uint8_t* row, int nb, int c0, int c1, int k, const Acts& x, RowSums* sums) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) {
    acc[r][0] = sums[r].acc[0];
    acc[r][1] = sums[r].acc[1];
  }
  alignas(32) float ds[R][kChunk];
  scale_products<R, K>(row, nb, c0, c1, x, ds, sums);
  // block i from its codes as block_codes gives them, into accumulator h of each row
  auto block = [&](int i, int h, __m256i wq) DI_INLINE_LAMBDA {
    const __m256i wu = K == WeightKind::Q8_0 ? _mm256_sign_epi8(wq, wq) : wq;
    for (int r = 0; r < R; ++r) {
      __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.qs + static_cast<size_t>(r) * k + i * kBlock));
      if constexpr (K == WeightKind::Q8_0) xq = _mm256_sign_epi8(xq, wq);
      acc[r][h] = _mm256_fmadd_ps(_mm256_broadcast_ss(&ds[r][i - c0]), dot_u8_s8(wu, xq), acc[r][h]);
    }
  };
  int g = c0;
  for (; g + 8 <= c1; g += 8) {
    const __m256i planes = group_planes<K>(row, nb, g);
    auto pair = [&](auto jc) DI_INLINE_LAMBDA {
      constexpr int J = decltype(jc)::value;
      __m256i w0, w1;
      pair_codes<K, J>(row, g, planes, w0, w1);
      block(g + J, 0, w0);
      block(g + J + 1, 1, w1);
    };
    pair(std::integral_constant<int, 0>{});
    pair(std::integral_constant<int, 2>{});
    pair(std::integral_constant<int, 4>{});
    pair(std::integral_constant<int, 6>{});
  }
  int i = g;  // the blocks after the whole groups (g is even)
  for (; i + 2 <= c1; i += 2) {
    block(i, 0, block_codes<K>(row, nb, i));
    block(i + 1, 1, block_codes<K>(row, nb, i + 1));
  }
  if (i < c1) block(i, 0, block_codes<K>(row, nb, i));
  for (int r = 0; r < R; ++r) {
    sums[r].acc[0] = acc[r][0];
    sums[r].acc[1] = acc[r][1];
  }
}

DI_INLINE float row_total(const RowSums& s) { return hsum(_mm256_add_ps(s.acc[0], s.acc[1])) + hsum(s.off) + s.off_tail; }

// Codes of block i of a row as block_codes gives them, for any block (a whole group's through its
// bit planes, with a shift by a count in a register).
template <WeightKind K>
DI_INLINE __m256i any_block_codes(const uint8_t* row, int nb, int i) {
  if constexpr (K != WeightKind::Q5_0) {
    return block_codes<K>(row, nb, i);
  } else {
    const int g = i & ~7;
    if (g + 8 > nb) return block_codes<K>(row, nb, i);
    const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + static_cast<size_t>(i & ~1) * code_bytes(K)));
    const __m256i planes = group_planes<K>(row, nb, g);
    const int j = i & 7;
    const __m256i at4 = j <= 4 ? _mm256_sll_epi16(planes, _mm_cvtsi32_si128(4 - j))
                               : _mm256_srl_epi16(planes, _mm_cvtsi32_si128(j - 4));
    return _mm256_or_si256(_mm256_and_si256(i & 1 ? _mm256_srli_epi16(t, 4) : t, _mm256_set1_epi8(0x0F)),
                           _mm256_and_si256(at4, _mm256_set1_epi8(0x10)));
  }
}

// R activation rows (5 <= R <= 8) against one weight row: tile_blocks' arithmetic with each block's
// codes unpacked once for the R rows and the accumulators on the stack (too many for registers;
// with 5-8 rows a block's latency is hidden anyway).
template <int R, WeightKind K>
void row_dots(const uint8_t* row, int nb, int k, const Acts& x, float* y, int ldy) {
  __m256 acc[R][2];
  RowSums sums[R];  // the offset terms (the accumulators above)
  alignas(32) float ds[R][kChunk];
  for (int r = 0; r < R; ++r) {
    acc[r][0] = acc[r][1] = sums[r].off = _mm256_setzero_ps();
    sums[r].off_tail = 0.0f;
  }
  for (int c0 = 0; c0 < nb; c0 += kChunk) {
    const int c1 = nb < c0 + kChunk ? nb : c0 + kChunk;
    scale_products<R, K>(row, nb, c0, c1, x, ds, sums);
    for (int i = c0; i < c1; ++i) {
      const __m256i wq = any_block_codes<K>(row, nb, i);
      const __m256i wabs = K == WeightKind::Q8_0 ? _mm256_sign_epi8(wq, wq) : wq;
      for (int r = 0; r < R; ++r) {
        __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.qs + static_cast<size_t>(r) * k + i * kBlock));
        if constexpr (K == WeightKind::Q8_0) xq = _mm256_sign_epi8(xq, wq);
        acc[r][i & 1] = _mm256_fmadd_ps(_mm256_broadcast_ss(&ds[r][i - c0]), dot_u8_s8(wabs, xq), acc[r][i & 1]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    sums[r].acc[0] = acc[r][0];
    sums[r].acc[1] = acc[r][1];
    y[static_cast<size_t>(r) * ldy] = row_total(sums[r]);
  }
}

// Weight rows are streamed from memory once per step (a model larger than the caches): the
// caches are asked for the row kPrefetchRows ahead while this one is computed (a decode row is
// otherwise as much waiting on memory as arithmetic; the hardware prefetcher alone does not run
// that far ahead). Never past the last row of the call.
constexpr int kPrefetchRows = 4;

DI_INLINE void prefetch_row_ahead(const uint8_t* w, size_t row_bytes, int n, int n1) {
  if (n + kPrefetchRows >= n1) return;
  const uint8_t* ahead = w + static_cast<size_t>(n + kPrefetchRows) * row_bytes;
  for (size_t o = 0; o < row_bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + o), _MM_HINT_T0);
}

// Weight rows [n0, n1) against the activation rows, in tiles of up to 8: tiles of 5-8 rows unpack a
// block's codes once for all their rows (row_dots, most of a small model's cost at those batch
// sizes on two cores: a speculative verify step of 1 + k rows, k <= 7, unpacks each weight row
// once as a decode row does); tiles of 1-4 rows keep everything in registers (tile_blocks). A
// row's arithmetic does not depend on the tile it is in (batch invariance).
template <WeightKind K>
void gemv_kind(const uint8_t* w, size_t row_bytes, int k, const Acts& x, int rows, float* y, int ldy, int n0, int n1) {
  const int nb = k / kBlock;
  for (int n = n0; n < n1; ++n) {
    const uint8_t* row = w + static_cast<size_t>(n) * row_bytes;
    prefetch_row_ahead(w, row_bytes, n, n1);
    for (int b = 0; b < rows;) {
      const int t = rows - b < 8 ? rows - b : 8;
      const Acts xb = acts_from_row(x, b, k);
      float* yb = y + static_cast<size_t>(b) * ldy + n;
      b += t;
      if (t > kTile) {
        switch (t) {
          case 5: row_dots<5, K>(row, nb, k, xb, yb, ldy); break;
          case 6: row_dots<6, K>(row, nb, k, xb, yb, ldy); break;
          case 7: row_dots<7, K>(row, nb, k, xb, yb, ldy); break;
          default: row_dots<8, K>(row, nb, k, xb, yb, ldy); break;
        }
        continue;
      }
      RowSums s[kTile];
      for (int r = 0; r < t; ++r) s[r] = RowSums{{_mm256_setzero_ps(), _mm256_setzero_ps()}, _mm256_setzero_ps(), 0.0f};
      for (int c0 = 0; c0 < nb; c0 += kChunk) {
        const int c1 = nb < c0 + kChunk ? nb : c0 + kChunk;
        switch (t) {
          case 1: tile_blocks<1, K>(row, nb, c0, c1, k, xb, s); break;
          case 2: tile_blocks<2, K>(row, nb, c0, c1, k, xb, s); break;
          case 3: tile_blocks<3, K>(row, nb, c0, c1, k, xb, s); break;
          default: tile_blocks<kTile, K>(row, nb, c0, c1, k, xb, s); break;
        }
      }
      for (int r = 0; r < t; ++r) yb[static_cast<size_t>(r) * ldy] = row_total(s[r]);
    }
  }
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
    prefetch_row_ahead(w, row_bytes, n, n1);
    for (int b = 0; b < rows;) {
      const Acts xb = acts_from_row(x, b, k);
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

// repack_row, then (Q5_0) the fifth bits of each whole group of 8 blocks as bit planes (kernels.h).
void repack_planes(WeightKind kind, const uint8_t* src, int nb, uint8_t* dst) {
  repack_row(kind, src, nb, dst);
  if (kind != WeightKind::Q5_0) return;
  uint8_t* bits = dst + static_cast<size_t>(nb) * (code_bytes(kind) + 2);
  for (int g = 0; g + 8 <= nb; g += 8) {
    uint32_t qh[8];
    std::memcpy(qh, bits + 4 * static_cast<size_t>(g), sizeof(qh));
    for (int c = 0; c < 4; ++c) {  // weights 8c..8c+7: an 8x8 bit matrix (byte b: block b's bits), transposed
      uint64_t m = 0;
      for (int b = 0; b < 8; ++b) m |= static_cast<uint64_t>((qh[b] >> (8 * c)) & 0xFFu) << (8 * b);
      uint64_t t = (m ^ (m >> 7)) & 0x00AA00AA00AA00AAull;
      m ^= t ^ (t << 7);
      t = (m ^ (m >> 14)) & 0x0000CCCC0000CCCCull;
      m ^= t ^ (t << 14);
      t = (m ^ (m >> 28)) & 0x00000000F0F0F0F0ull;
      m ^= t ^ (t << 28);
      for (int j = 0; j < 8; ++j) bits[4 * static_cast<size_t>(g) + 8 * c + j] = static_cast<uint8_t>(m >> (8 * j));
    }
  }
}

void repack(WeightKind kind, const uint8_t* src, size_t row_bytes, int rows, int nb, uint8_t* dst) {
  repack_each(repack_planes, kind, src, row_bytes, rows, nb, dst);
}

// ---- K-quants (ggml's super-block layout as stored, see kernels.h) ----------------------------

// The 8 weight-scale factors d sc_j and min factors dmin m_j of a Q4_K/Q5_K super-block (6-bit
// sc_j, m_j from its 12 scale bytes q: j < 4: sc = q[j] & 63, m = q[j + 4] & 63; j >= 4:
// sc = q[j + 4] & 15 | (q[j - 4] >> 6) << 4, m = q[j + 4] >> 4 | (q[j] >> 6) << 4; 4 at a time).
DI_INLINE void scale_factors_k4(const uint8_t* blk, __m256& dsc, __m256& dm) {
  uint32_t a, b, c;  // scale bytes 0-3, 4-7, 8-11
  std::memcpy(&a, blk + 4, 4);
  std::memcpy(&b, blk + 8, 4);
  std::memcpy(&c, blk + 12, 4);
  const uint32_t low6 = 0x3F3F3F3Fu, low4 = 0x0F0F0F0Fu, top2 = 0x03030303u;
  const uint64_t sc = (a & low6) | static_cast<uint64_t>((c & low4) | (((a >> 6) & top2) << 4)) << 32;
  const uint64_t m = (b & low6) | static_cast<uint64_t>(((c >> 4) & low4) | (((b >> 6) & top2) << 4)) << 32;
  const auto as_floats = [](uint64_t bytes) DI_INLINE_LAMBDA {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(bytes))));
  };
  dsc = _mm256_mul_ps(_mm256_set1_ps(half_at(blk)), as_floats(sc));
  dm = _mm256_mul_ps(_mm256_set1_ps(half_at(blk + 2)), as_floats(m));
}

// R activation rows against one K-quant weight row of nsb super-blocks. Per chunk of super-blocks
// the products of weight and activation scales are formed 8 sub-blocks at a time first (Q4_K/Q5_K:
// d sc_j xd, with the mins' terms -dmin m_j xs a lane each; Q6_K: d xd), then per sub-block of 32
// the codes are unpacked once for the R rows (per pair of sub-blocks, with compile-time shifts)
// and each row costs its integer dot and one FMA, into one of two accumulators (even and odd
// sub-blocks). Q4_K/Q5_K: codes unsigned (maddubs against the signed activations). Q6_K: codes - 32
// signed (|w| times x with w's sign), the two 16-weight halves weighted by their int8 scales in
// one madd. A row's operations and their order do not depend on R (batch invariance).
template <int R, WeightKind K>
void row_dots_k(const uint8_t* row, int nsb, int k, const Acts& x, float* y, int ldy) {
  constexpr size_t bb = block_bytes(K);
  constexpr int kChunkSuper = kChunk / 8;
  const int nb = k / kBlock;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 acc[R][2], off[R];
  alignas(32) float ds[R][kChunk];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = off[r] = _mm256_setzero_ps();
  for (int s0 = 0; s0 < nsb; s0 += kChunkSuper) {
    const int s1 = nsb < s0 + kChunkSuper ? nsb : s0 + kChunkSuper;
    for (int s = s0; s < s1; ++s) {
      const uint8_t* blk = row + static_cast<size_t>(s) * bb;
      __m256 wsc, wm = _mm256_setzero_ps();
      if constexpr (K == WeightKind::Q6_K) {
        wsc = _mm256_set1_ps(half_at(blk + 208));
      } else {
        scale_factors_k4(blk, wsc, wm);
      }
      for (int r = 0; r < R; ++r) {
        const size_t at = static_cast<size_t>(r) * nb + 8 * static_cast<size_t>(s);
        _mm256_store_ps(ds[r] + 8 * (s - s0), _mm256_mul_ps(wsc, _mm256_loadu_ps(x.d + at)));
        if constexpr (K != WeightKind::Q6_K) off[r] = _mm256_fnmadd_ps(wm, _mm256_loadu_ps(x.s + at), off[r]);
      }
    }
    for (int s = s0; s < s1; ++s) {
      const uint8_t* blk = row + static_cast<size_t>(s) * bb;
      const int i0 = 8 * s;  // activation block of sub-block 0
      // sub-block j's codes (unsigned; Q6_K: |w|, signs and scale pair alongside) into accumulator j % 2
      auto block = [&](int j, __m256i wu, __m256i ws, __m256i scales) DI_INLINE_LAMBDA {
        const int i = i0 + j;
        for (int r = 0; r < R; ++r) {
          const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.qs + static_cast<size_t>(r) * k + i * kBlock));
          __m256 p;
          if constexpr (K == WeightKind::Q6_K) {
            p = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(wu, _mm256_sign_epi8(xq, ws)), scales));
          } else {
            p = dot_u8_s8(wu, xq);
          }
          acc[r][j & 1] = _mm256_fmadd_ps(_mm256_broadcast_ss(&ds[r][i - 8 * s0]), p, acc[r][j & 1]);
        }
      };
      if constexpr (K == WeightKind::Q6_K) {
        // int8 scales as int16, pair j (halves of sub-block j) as int32 lane j
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
        const __m256i spread = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 2,
                                                3, 2, 3, 2, 3, 2, 3);
        auto sub = [&](auto jc) DI_INLINE_LAMBDA {
          constexpr int J = decltype(jc)::value, H = J / 4, U = J % 4;
          const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * H + 32 * (U & 1)));
          const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * H));
          const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(ql, 4 * (U >> 1)), low4);
          // bits 2U, 2U + 1 of each byte of qh -> bits 4, 5 (one shift of the 16-bit lanes, then a mask)
          __m256i hi;
          if constexpr (U < 2) {
            hi = _mm256_slli_epi16(qh, 4 - 2 * U);
          } else if constexpr (U == 2) {
            hi = qh;
          } else {
            hi = _mm256_srli_epi16(qh, 2);
          }
          hi = _mm256_and_si256(hi, _mm256_set1_epi8(0x30));
          const __m256i wq = _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32));
          const __m256i scales = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(sc16, _mm256_set1_epi32(J)), spread);
          block(J, _mm256_sign_epi8(wq, wq), wq, scales);
        };
        sub(std::integral_constant<int, 0>{});
        sub(std::integral_constant<int, 1>{});
        sub(std::integral_constant<int, 2>{});
        sub(std::integral_constant<int, 3>{});
        sub(std::integral_constant<int, 4>{});
        sub(std::integral_constant<int, 5>{});
        sub(std::integral_constant<int, 6>{});
        sub(std::integral_constant<int, 7>{});
      } else {
        const uint8_t* qs = blk + (K == WeightKind::Q5_K ? 48 : 16);
        __m256i qh = _mm256_setzero_si256();
        if constexpr (K == WeightKind::Q5_K) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16));
        auto pair = [&](auto pc) DI_INLINE_LAMBDA {  // sub-blocks 2P (low nibbles) and 2P + 1 (high)
          constexpr int P = decltype(pc)::value;
          const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * P));
          __m256i w0 = _mm256_and_si256(t, low4), w1 = _mm256_and_si256(_mm256_srli_epi16(t, 4), low4);
          if constexpr (K == WeightKind::Q5_K) {  // fifth bit j of each byte -> 0x10 (as Q5_0's planes)
            const __m256i bit4 = _mm256_set1_epi8(0x10);
            __m256i b0, b1;
            if constexpr (2 * P < 4) {
              b0 = _mm256_slli_epi16(qh, 4 - 2 * P);
              b1 = _mm256_slli_epi16(qh, 3 - 2 * P);
            } else if constexpr (2 * P == 4) {
              b0 = qh;
              b1 = _mm256_srli_epi16(qh, 1);
            } else {
              b0 = _mm256_srli_epi16(qh, 2 * P - 4);
              b1 = _mm256_srli_epi16(qh, 2 * P - 3);
            }
            w0 = _mm256_or_si256(w0, _mm256_and_si256(b0, bit4));
            w1 = _mm256_or_si256(w1, _mm256_and_si256(b1, bit4));
          }
          block(2 * P, w0, w0, w0);
          block(2 * P + 1, w1, w1, w1);
        };
        pair(std::integral_constant<int, 0>{});
        pair(std::integral_constant<int, 1>{});
        pair(std::integral_constant<int, 2>{});
        pair(std::integral_constant<int, 3>{});
      }
    }
  }
  for (int r = 0; r < R; ++r) y[static_cast<size_t>(r) * ldy] = hsum(_mm256_add_ps(acc[r][0], acc[r][1])) + hsum(off[r]);
}

template <WeightKind K>
void gemv_k(const uint8_t* w, size_t row_bytes, int k, const Acts& x, int rows, float* y, int ldy, int n0, int n1) {
  gemv_tiles(w, row_bytes, k, x, rows, y, ldy, n0, n1, [ldy](auto r, const uint8_t* row, int, int kk, const Acts& xb, float* yb) {
    row_dots_k<decltype(r)::value, K>(row, kk / kSuper, kk, xb, yb, ldy);
  });
}

void gemv_quant(WeightKind kind, const uint8_t* w, size_t row_bytes, int /*n_rows*/, int k, const Acts& x, int rows,
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

#undef DI_INLINE
#undef DI_INLINE_LAMBDA

}  // namespace

const Kernels& avx2_kernels() {
  // quantize_row: bitwise the generic one (the tables quantize activations alike).
  static const Kernels table{"avx2", gemv_quant, gemv_f32, quantize_row, dot, axpy,
                             silu_mul, attend, attend_many, repack};
  return table;
}

}  // namespace deepinfer::cpu

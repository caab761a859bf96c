// Matrix-vector kernels of the native CPU decode path, one table per instruction set.
//
// Quantized weights come from a GGUF file in ggml's block layouts (32 weights per block):
//   Q4_0: fp16 d, 16 bytes of nibbles          w = (q - 8) * d
//   Q4_1: fp16 d, fp16 m, 16 bytes of nibbles  w = q * d + m
//   Q8_0: fp16 d, 32 int8                      w = q * d
// (nibble j of a block: low half of byte j for j < 16, high half of byte j - 16 otherwise), and
// are regrouped once at registration, row by row and with the same bytes per row, as
//   [codes of every block][fp16 d of every block]([fp16 m of every block] for Q4_1)
// so that a row's scales convert and multiply 8 at a time (repack_row). Q4 codes go in pairs of
// blocks: byte j of pair (2p, 2p + 1) holds weight j of block 2p in its low nibble and weight j
// of block 2p + 1 in its high one (j < 32), so one 32-byte load, a shift and a mask give both
// blocks' 64 codes in element order; an odd last block keeps ggml's 16-byte layout.
// K-quants come in super-blocks of 256 weights (8 sub-blocks of 32) and run in ggml's layout
// as stored (no regrouping; the AVX-512 table's groups of 16 rows aside, below):
//   Q4_K (144 bytes): fp16 d, fp16 dmin, 12 bytes of 6-bit sub-block scales sc and mins m,
//        128 bytes of nibbles                      w = d * sc_j * q - dmin * m_j
//   Q5_K (176 bytes): as Q4_K plus 32 bytes of fifth bits (bit j of byte l: weight l of
//        sub-block j)                              w = d * sc_j * q - dmin * m_j, q < 32
//   Q6_K (210 bytes): 128 bytes of low nibbles, 64 of high pairs, 16 int8 scales (one per 16
//        weights), fp16 d                          w = d * sc_i * (q - 32), q < 64
// Q5_0 (22 bytes: fp16 d, 32 fifth bits (bit j: weight j), 16 bytes of nibbles in Q4_0's order,
// w = (q - 16) * d) is regrouped as Q4_0 is, its fifth bits after the scales:
//   [nibbles of every block, paired as Q4's][fp16 d of every block][4 bytes of fifth bits of every block]
// so that the fifth bits of a pair of blocks are one 64-bit load (one byte mask on AVX-512). The
// AVX2 table regroups them further (its Kernels::repack): the 32 bytes of fifth bits of each
// whole group of 8 blocks 8g..8g+7 (at the same place) become bit planes, bit b of byte j = the
// fifth bit of weight j of block 8g + b, so that a block's bits are a shift and a mask of one load;
// the blocks after the last whole group keep their 4 bytes.
// The AVX-512 table interleaves the weights of every quantized kind, K-quants included, by groups
// of 16 rows (kernels_avx512.cpp: one 32-bit lane per weight row, so a 512-bit integer dot serves
// 16 rows and an activation's 4 codes are one broadcast); rows after the last whole group keep the
// per-row layout above (K-quants: ggml's, as stored).
// Activations multiplied by quantized weights are quantized to 8 bits per block of 32 (as
// ggml's Q8_1): x ~= q * d, |x - q * d| <= d / 2 with d = max|x| / 127, and s = d * sum(q).
#pragma once

#include <cstddef>
#include <cstdint>

namespace deepinfer::cpu {

// values: ggml's type ids
enum class WeightKind : int { F32 = 0, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

constexpr int kBlock = 32;
constexpr int kSuper = 256;  // weights per K-quant super-block

constexpr bool k_quant(WeightKind k) {
  return k == WeightKind::Q4_K || k == WeightKind::Q5_K || k == WeightKind::Q6_K;
}

// weights per block of the kind's ggml layout
constexpr int block_weights(WeightKind k) { return k_quant(k) ? kSuper : kBlock; }

// bytes of one block of block_weights(k) weights (F32: 128)
constexpr size_t block_bytes(WeightKind k) {
  switch (k) {
    case WeightKind::F32: return 4 * kBlock;
    case WeightKind::Q4_0: return 18;
    case WeightKind::Q4_1: return 20;
    case WeightKind::Q5_0: return 22;
    case WeightKind::Q8_0: return 34;
    case WeightKind::Q4_K: return 144;
    case WeightKind::Q5_K: return 176;
    case WeightKind::Q6_K: return 210;
  }
  return 0;
}

// Quantized activation rows: row r has codes qs[r * k ..], scales d[r * k / 32 ..], block
// sums s[r * k / 32 ..] (s = d * sum of the block's codes, for the offsets of Q4_1 and the
// K-quants' mins) and the codes' integer sums per half block, sum[r * k / 16 ..] (code_sums; the
// AVX-512 kernels take the code offsets of Q4_0/Q5_0/Q8_0, and of Q6_K's 16-weight halves, out of
// the integer dots with them, exactly).
struct Acts {
  const int8_t* qs;
  const float* d;
  const float* s;
  const int32_t* sum;
};

// x's rows from row b on (k codes a row). Out of line: the ISA files share no inline functions.
Acts acts_from_row(const Acts& x, int b, int k);

// The integer sum of each 16 codes of one activation row of k codes (k / 16 sums).
void code_sums(const int8_t* qs, int k, int32_t* out);

// bytes of the codes of one block (the regrouped row holds nb of these, then the scales)
constexpr size_t code_bytes(WeightKind k) { return k == WeightKind::Q8_0 ? 32 : 16; }

// Kinds whose kernels read ggml's blocks as stored (repack_row copies them).
constexpr bool as_stored(WeightKind k) { return k_quant(k); }

// One row of nb ggml blocks -> the regrouped layout (same size; as_stored kinds: a copy).
void repack_row(WeightKind kind, const uint8_t* src, int nb, uint8_t* dst);

// One row of `cols` weights in ggml's layout (any quantized kind) -> float32, with the float32
// operations of gguf.quants' dequantization.
void dequantize_ggml_row(WeightKind kind, const uint8_t* src, int cols, float* out);

struct Kernels {
  const char* name;
  // y[b * ldy + n] = dot(weight row n, activation row b) for n in [n0, n1), b < rows.
  // Quantized: w is this table's repack of a weight of n_rows rows of row_bytes (k inputs);
  // x holds `rows` activation rows.
  void (*gemv_quant)(WeightKind kind, const uint8_t* w, size_t row_bytes, int n_rows, int k, const Acts& x,
                     int rows, float* y, int ldy, int n0, int n1);
  // F32: w [n, k] row-major; x [rows, k] row-major.
  void (*gemv_f32)(const float* w, int k, const float* x, int rows, float* y, int ldy, int n0, int n1);
  // x [k] -> codes qs [k], scales d [k / 32], sums s [k / 32]
  void (*quantize_row)(const float* x, int k, int8_t* qs, float* d, float* s);
  float (*dot)(const float* a, const float* b, int n);
  void (*axpy)(float a, const float* x, float* y, int n);  // y += a * x
  // out[i] = silu(gate[i]) * up[i]
  void (*silu_mul)(const float* gate, const float* up, float* out, int n);
  // One query head q [d] over `len` cached tokens: out [d] = softmax(scale * q.k_t) . v_t, token
  // t's k and v at k / v + slot(t) * stride, slot(t) = table[t / block_size] * block_size +
  // t % block_size. scores: room for len floats.
  void (*attend)(const float* q, int d, const float* k, const float* v, size_t stride, const int64_t* table,
                 int block_size, int len, float scale, float* scores, float* out);
  // n query heads over one sequence's cache and one kv head (one table, k, v): query i is qs[i]
  // [d] over lens[i] tokens into outs[i] [d], each bitwise what `attend` gives it alone (the vector
  // tables load each token's k and v once for all of them). work: attend_work_floats(n, max len, d).
  void (*attend_many)(const float* const* qs, float* const* outs, const int* lens, int n, int d, const float* k,
                      const float* v, size_t stride, const int64_t* table, int block_size, float scale, float* work);
  // A weight of `rows` rows of nb ggml blocks (row_bytes each) -> the layout this table's
  // gemv_quant reads (same size): repack_row per row, or a table's own refinement of it (the AVX2
  // table's Q5_0 planes, the AVX-512 table's groups of 16 rows; see above).
  void (*repack)(WeightKind kind, const uint8_t* src, size_t row_bytes, int rows, int nb, uint8_t* dst);
};

// `repack` as one row_fn call per row (row_fn: repack_row, or a table's per-row refinement).
void repack_each(void (*row_fn)(WeightKind, const uint8_t*, int, uint8_t*), WeightKind kind, const uint8_t* src,
                 size_t row_bytes, int rows, int nb, uint8_t* dst);

// Floats of `work` that attend_many takes for n queries of at most max_len tokens and head size d.
inline size_t attend_work_floats(int n, int max_len, int d) {
  return static_cast<size_t>(n) * ((static_cast<size_t>(max_len) + 7) / 8 * 8 + static_cast<size_t>(d) + 1);
}

// attend_many as one `attend_fn` call per query (the portable tables, and head sizes without a
// vector kernel).
void attend_each(void (*attend_fn)(const float*, int, const float*, const float*, size_t, const int64_t*, int, int,
                                   float, float*, float*),
                 const float* const* qs, float* const* outs, const int* lens, int n, int d, const float* k,
                 const float* v, size_t stride, const int64_t* table, int block_size, float scale, float* work);

const Kernels& generic_kernels();
// The portable attention over a table's own dot/axpy (the vector tables' fallback).
void attend_with(float (*dot_fn)(const float*, const float*, int), void (*axpy_fn)(float, const float*, float*, int),
                 const float* q, int d, const float* k, const float* v, size_t stride, const int64_t* table,
                 int block_size, int len, float scale, float* scores, float* out);
#if defined(DEEPINFER_HAVE_AVX2_KERNELS)
const Kernels& avx2_kernels();
const Kernels& avx512_kernels();  // AVX-512 VNNI quantized GEMV, AVX2 float kernels
#endif
// The fastest table the CPU running us supports (checked once).
const Kernels& best_kernels();

float fp16_to_float(uint16_t h);

}  // namespace deepinfer::cpu

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
// Activations multiplied by quantized weights are quantized to 8 bits per block of 32 (as
// ggml's Q8_1): x ~= q * d, |x - q * d| <= d / 2 with d = max|x| / 127, and s = d * sum(q).
#pragma once

#include <cstddef>
#include <cstdint>

namespace deepinfer::cpu {

enum class WeightKind : int { F32 = 0, Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };

constexpr int kBlock = 32;

// bytes of one block of 32 weights (F32: 128)
constexpr size_t block_bytes(WeightKind k) {
  switch (k) {
    case WeightKind::F32: return 4 * kBlock;
    case WeightKind::Q4_0: return 18;
    case WeightKind::Q4_1: return 20;
    case WeightKind::Q8_0: return 34;
  }
  return 0;
}

// Quantized activation rows: row r has codes qs[r * k ..], scales d[r * k / 32 ..] and block
// sums s[r * k / 32 ..] (s = d * sum of the block's codes, for the offsets of Q4_0 and Q4_1).
struct Acts {
  const int8_t* qs;
  const float* d;
  const float* s;
};

// bytes of the codes of one block (the regrouped row holds nb of these, then the scales)
constexpr size_t code_bytes(WeightKind k) { return k == WeightKind::Q8_0 ? 32 : 16; }

// One row of nb ggml blocks -> the regrouped layout (same size).
void repack_row(WeightKind kind, const uint8_t* src, int nb, uint8_t* dst);

struct Kernels {
  const char* name;
  // y[b * ldy + n] = dot(weight row n, activation row b) for n in [n0, n1), b < rows.
  // Quantized: w points at regrouped row 0, row_bytes apart; x holds `rows` activation rows.
  void (*gemv_quant)(WeightKind kind, const uint8_t* w, size_t row_bytes, int k, const Acts& x, int rows,
                     float* y, int ldy, int n0, int n1);
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
};

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

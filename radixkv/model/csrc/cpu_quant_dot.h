// y = x W^T with W in GGML's block-quantized formats and x quantized to int8 per 32-block (as
// llama.cpp multiplies): integer dot products, one float scale per block (see cpu_quant_dot.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

// The GGML type ids quant_gemm_q8_into multiplies: Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 (every build; the
// portable one with the same integer arithmetic in scalar code).
std::vector<int64_t> quant_dot_types();
// The largest M quant_gemm_q8_into takes (a decode batch; prefill rows use quant_gemm_into).
int64_t quant_dot_max_rows();
// out[m, n] ~= sum_k x[m, k] Wdeq[n, k] for n < N, with x's rows quantized per 32-block to int8
// codes q and a float32 scale d = amax / 127 (q = round-to-nearest-even(x * (127 / amax)), in
// float32): x [M <= 8, K] float32 contiguous; w [N, row_bytes] uint8 raw GGML rows of ggml_type
// (as quant_gemm_into); out [M, >= N] float32, out.stride(1) == 1 (a column slice of a wider
// tensor is written in place, its other columns untouched). The per-block dots of weight codes
// and x codes are exact integers; each block adds (d_w d_x) * dot (plus m_w d_x sum(q) for
// Q4_1) to a float32 sum. Error bound: cpu_quant_dot.cpp's header. terms = 2 (M <= 4): each
// row of x is two int8 rows, its codes and the codes of what they leave (x - d q, quantized the
// same way), the two products summed: x's error <= amax / 64516 a block, below bfloat16's.
void quant_gemm_q8_into(const at::Tensor& x, const at::Tensor& w, int64_t ggml_type,
                        const at::Tensor& out, int64_t terms = 1);
// A linear's one call: a new [M, N] tensor of x's dtype, x W^T through quant_gemm_q8_into when x
// is float32 with 1 <= M <= min(int8_rows, quant_dot_max_rows() / terms) and ggml_type is one it
// serves, else through quant_gemm (float activations). int8_rows = 0: always quant_gemm. x [M, K]
// 2-D (made contiguous here); w and terms as quant_gemm_q8_into's.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& w, int64_t ggml_type,
                        int64_t int8_rows, int64_t terms = 1);

// The same multiply for a caller that runs its own threads (cpu_decoder.cpp's team of threads
// inside one OpenMP region): x quantized once per thread, each thread its share of output rows.
// quant_gemm_q8_into is quantize_rows + dot_rows_range over radixkv_work::unit_rows (unit
// kGroupRows), so the two agree bit for bit.
namespace radixkv_qdot {

// Output rows are multiplied in groups of kGroupRows (rows 8i .. 8i + 7, the N % 8 last one at a
// time); a worker's share is whole groups, so no output's arithmetic depends on the split.
constexpr int64_t kGroupRows = 8;

// x [m <= quant_dot_max_rows(), k] quantized per 32-block. Codes row-major [m, k]; scales and
// (Q4_1) scaled code sums block-major [nb, 8], so one block's values for every row are adjacent.
// The vectors keep their capacity between calls (no allocation once grown).
// Two-term activations: rows [out_m, m) are the second terms of rows [0, out_m), whose products
// the kernels add to the first's (m = out_m with one term).
struct QuantizedRows {
  int64_t m = 0, out_m = 0, nb = 0;
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int32_t> sum8;  // 8 sum_k q_k: dot(nibble - 8, q) = dot(nibble, q) - sum8
};

// Quantizes x [m, k] (float32, contiguous rows, k a multiple of 32) into out: one int8 term a row,
// or two (terms = 2, m <= 4; quant_gemm_q8_into's).
void quantize_rows(const float* x, int64_t m, int64_t k, QuantizedRows& out, int64_t terms = 1);
// Whether quant_gemm_q8_into multiplies this GGML type (quant_dot_types()).
bool is_dot_type(int64_t ggml_type);
// Whether a linear of ggml_type takes int8 activations for m rows of float32 x: a dot type and
// 1 <= m <= min(int8_rows, quant_dot_max_rows() / terms) (quant_linear's rule, and the decoder
// team's).
bool serves_rows(int64_t ggml_type, int64_t int8_rows, int64_t m, int64_t terms);
// Bytes of one block of 32 weights of a dot type (Q4_0 18, Q4_1 20, Q8_0 34).
int64_t block_bytes(int64_t ggml_type);
// y[r * ldy + n] for rows r < xq.m and outputs n0 <= n < n1 (n0 a multiple of kGroupRows): w's
// raw GGML rows of ggml_type, row_bytes each, k inputs. Unchecked: the caller checked the shapes
// (as quant_gemm_q8_into does) and the type (is_dot_type).
void dot_rows_range(int64_t ggml_type, const uint8_t* w, int64_t row_bytes,
                    const QuantizedRows& xq, int64_t k, float* y, int64_t ldy, int64_t n0,
                    int64_t n1);

}  // namespace radixkv_qdot

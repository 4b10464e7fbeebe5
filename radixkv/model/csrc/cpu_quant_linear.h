// y = x W^T with W in GGML's block-quantized formats, kept as the GGUF file's raw rows (see
// cpu_quant_linear.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

// The GGML type ids quant_gemm_into multiplies natively: Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12,
// Q6_K = 14 (every build; the portable one with scalar decoding).
std::vector<int64_t> quant_gemm_types();
// out[m, n] = sum_k x[m, k] Wdeq[n, k] for n < N: x [M, K] float32 or bf16; w [N, row_bytes]
// uint8, each row output channel n's K weights as consecutive GGML blocks of `ggml_type` (the
// GGUF tensor's data as stored); out [M, >= N] float32 or x's dtype with out.stride(1) == 1 (a
// column slice of a wider tensor is written in place, its other columns untouched). Wdeq is
// GGML's dequantized weight, exactly (each weight decodes to the same float32 as
// gguf.quants.dequantize); the sums run in float32.
void quant_gemm_into(const at::Tensor& x, const at::Tensor& w, int64_t ggml_type,
                     const at::Tensor& out);
// quant_gemm_into into a fresh [M, N] tensor of x's dtype.
at::Tensor quant_gemm(const at::Tensor& x, const at::Tensor& w, int64_t ggml_type);
// Rows ids [T] (int64, each in [0, N)) of w dequantized, as a [T, K] tensor of dtype (float32
// exactly as gguf.quants.dequantize; bf16/fp16 rounded from it).
at::Tensor quant_dequantize_rows(const at::Tensor& w, int64_t ggml_type, const at::Tensor& ids,
                                 at::ScalarType dtype);

// quant_gemm_into's decode path (AVX2 builds, at most decode_rows_max() rows of float32 x) for a
// caller that runs its own threads (cpu_decoder.cpp's team): x prepared once per thread, each
// thread its share of output rows; quant_gemm_into is decode_input + decode_rows_range over
// radixkv_work::unit_rows (unit kRowUnit), so the two agree bit for bit.
namespace radixkv_qlin {

// The most rows of x the decode path takes (8), or 0 where the build has none (portable).
int64_t decode_rows_max();
// Workers share output rows in whole units of kRowUnit (panel rows / a cache line of float
// outputs): radixkv_work::unit_workers / unit_rows.
constexpr int64_t kRowUnit = 4;
// x [m, k] (float32, contiguous) as the decode path of ggml_type reads it: in `scratch` (a
// nibble format's groups reordered) or x itself. Raises for a type quant_gemm_into refuses.
const float* decode_input(int64_t ggml_type, const float* x, int64_t m, int64_t k,
                          std::vector<float>& scratch);
// y[r * ldy + n] for rows r < m of x and outputs n0 <= n < n1 (n0 a unit_rows start), xd from
// decode_input. Unchecked beyond the type: the caller checked the shapes.
void decode_rows_range(int64_t ggml_type, const uint8_t* w, int64_t row_bytes, const float* xd,
                       int64_t m, int64_t k, float* y, int64_t ldy, int64_t n0, int64_t n1);
// Bytes of a row of k weights of ggml_type (raises for a type quant_gemm_into refuses).
int64_t row_bytes_of(int64_t ggml_type, int64_t k);

}  // namespace radixkv_qlin

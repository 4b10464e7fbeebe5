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

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
// Q4_1) to a float32 sum. Error bound: cpu_quant_dot.cpp's header.
void quant_gemm_q8_into(const at::Tensor& x, const at::Tensor& w, int64_t ggml_type,
                        const at::Tensor& out);
// A linear's one call: a new [M, N] tensor of x's dtype, x W^T through quant_gemm_q8_into when x
// is float32 with 1 <= M <= min(int8_rows, quant_dot_max_rows()) and ggml_type is one it serves,
// else through quant_gemm (float activations). int8_rows = 0: always quant_gemm. x [M, K] 2-D
// (made contiguous here); w as quant_gemm_q8_into's.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& w, int64_t ggml_type,
                        int64_t int8_rows);

// bf16 linears with radixkv's own packed weights (AVX512-BF16 builds; see cpu_linear.cpp).
#pragma once

#include <ATen/core/Tensor.h>

// Whether this build has the AVX512-BF16 GEMM (false: the two functions below raise).
bool has_bf16_gemm();
// W [N, K] bf16 (N % 16 == 0, K even) -> its packed form [N / 16, K / 2, 16, 2].
at::Tensor pack_bf16_weight(const at::Tensor& w);
// y [M, N] = x [M, K] W^T in bf16 (float32 accumulation, one rounding), W given packed.
at::Tensor bf16_gemm(const at::Tensor& x, const at::Tensor& packed);

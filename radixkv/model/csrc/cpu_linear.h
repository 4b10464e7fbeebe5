// CPU linears with radixkv's own packed weights (see cpu_linear.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

// Whether this build has the AVX512-BF16 GEMM / the float32 GEMM (AVX2 or AVX-512 builds);
// without it the GEMM below raises.
bool has_bf16_gemm();
bool has_f32_gemm();
// Output columns per packed float32 block in this build (its vector width).
int64_t f32_gemm_cols();
// The packed bf16 block: output columns, and inputs per step (16, 2).
std::tuple<int64_t, int64_t> bf16_gemm_block();
// W [N, K] bf16 (N % 16 == 0, K even) -> its packed form [N / 16, K / 2, 32].
at::Tensor pack_bf16_weight(const at::Tensor& w);
// y [M, N] = x [M, K] W^T in bf16 (float32 accumulation, one rounding), W given packed.
at::Tensor bf16_gemm(const at::Tensor& x, const at::Tensor& packed);
// Whether bf16_gemm_amx can run here (an AVX512-BF16 build on an AMX-BF16 host whose kernel
// granted the tile state).
bool bf16_gemm_amx_available();
// bf16_gemm on AMX tiles, the same packed weight (K % 32 == 0); the same float32 sums per
// output up to the order within each 32-input step, one rounding.
at::Tensor bf16_gemm_amx(const at::Tensor& x, const at::Tensor& packed);
// W [N, K] float32 (N % f32_gemm_cols() == 0) -> [N / cols, K, cols].
at::Tensor pack_f32_weight(const at::Tensor& w);
// y [M, N] = x [M, K] W^T in float32, W from pack_f32_weight.
at::Tensor f32_gemm(const at::Tensor& x, const at::Tensor& packed);

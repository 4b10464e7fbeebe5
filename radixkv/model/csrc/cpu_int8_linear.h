// Weight-only int8 linears with per-output-channel scales (``--quantization int8``), see
// cpu_int8_linear.cpp.
#pragma once

#include <ATen/core/Tensor.h>

// The most rows of x int8_linear_rows takes (a decode step's few users).
int64_t int8_linear_max_rows();
// y [M, N] = x [M, K] (q * s)^T: q int8 [N, K] (contiguous), s [N], x and s float32 or bfloat16,
// 1 <= M <= int8_linear_max_rows(); y float32 (the caller rounds it to x's dtype).
at::Tensor int8_linear_rows(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s);

// Fused elementwise layers (bf16 or float32 rows) for the CPU forward pass (see cpu_fused.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros_like.h>

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm(at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight,
                        double eps);
at::Tensor silu_mul(const at::Tensor& gate_up);
void rope_(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
           int64_t head_dim);

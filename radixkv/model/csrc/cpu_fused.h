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

// The float32 rows of the ops above on raw pointers, rows [begin, end) (y and the gate / up rows
// contiguous, h or n values a row), for a caller that runs its own threads (cpu_decoder.cpp):
// the ops call the same code, so the results agree bit for bit.
void rms_norm_rows_f32(const float* x, int64_t x_stride, const float* w, float* y, int64_t h,
                       float eps, int64_t begin, int64_t end);
void add_rms_norm_rows_f32(float* residual, int64_t residual_stride, const float* x,
                           int64_t x_stride, const float* w, float* y, int64_t h, float eps,
                           int64_t begin, int64_t end);
void silu_mul_rows_f32(const float* gate_up, int64_t stride, float* y, int64_t n, int64_t begin,
                       int64_t end);

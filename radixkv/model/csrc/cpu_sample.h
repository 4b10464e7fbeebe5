// The sampler's batched inverse-CDF draw and the grammar masks' apply (see cpu_sample.cpp).
#pragma once

#include <ATen/core/Tensor.h>

at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& inv_temperature,
                       const at::Tensor& uniforms);

void apply_token_bitmask_(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows);

at::Tensor argmax_rows(const at::Tensor& logits);

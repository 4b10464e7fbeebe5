// The sampler's batched inverse-CDF draw (see cpu_sample.cpp).
#pragma once

#include <ATen/core/Tensor.h>

at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& inv_temperature,
                       const at::Tensor& uniforms);

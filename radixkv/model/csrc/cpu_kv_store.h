// Writing quantized KV rows and the rotation they are stored in (see cpu_kv_store.cpp).
#pragma once

#include <ATen/core/Tensor.h>

at::Tensor hadamard_rows(const at::Tensor& x, double scale);
void store_kv_quant_(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                     at::Tensor& v_cache, const at::Tensor& slots);
void store_kv_(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
               const at::Tensor& slots);

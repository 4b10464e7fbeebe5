// Writing quantized KV rows and the rotation they are stored in (see cpu_kv_store.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

at::Tensor hadamard_rows(const at::Tensor& x, double scale);
void hadamard_rows_(at::Tensor& x, double scale);
void rope_hadamard_(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                    int64_t rope_heads, int64_t heads, int64_t head_dim);
void store_kv_quant_(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                     at::Tensor& v_cache, const at::Tensor& slots);
void store_kv_(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
               const at::Tensor& slots);

void copy_pages_(std::vector<at::Tensor> caches, const at::Tensor& src, const at::Tensor& dst);

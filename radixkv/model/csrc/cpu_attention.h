// Paged attention for the CPU over radixkv's KV pool (see cpu_attention.cpp).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

at::Tensor paged_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                           at::Tensor page_table, std::vector<int64_t> prefix_lens,
                           std::vector<int64_t> extend_lens, std::vector<int64_t> extend_starts,
                           double sm_scale);
bool has_fast_path(int64_t head_dim);

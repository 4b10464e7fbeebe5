// Paged attention for the CPU over radixkv's KV pool (see cpu_attention.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros_like.h>

#include <cstdint>
#include <vector>

at::Tensor paged_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                           at::Tensor page_table, std::vector<int64_t> prefix_lens,
                           std::vector<int64_t> extend_lens, std::vector<int64_t> extend_starts,
                           double sm_scale);
bool has_fast_path(int64_t head_dim);
// float32 math over float32 / bf16 / fp16 pools, with shared-prefix groups (cpu_attention_f32.cpp)
at::Tensor paged_attention_f32(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                               at::Tensor page_table, std::vector<int64_t> prefix_lens,
                               std::vector<int64_t> extend_lens,
                               std::vector<int64_t> extend_starts, double sm_scale,
                               std::vector<int64_t> group_members,
                               std::vector<int64_t> group_offsets,
                               std::vector<int64_t> group_shared);
const char* f32_kernel_isa();

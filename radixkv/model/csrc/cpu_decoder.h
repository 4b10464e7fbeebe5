// A stack of decoder layers in one native call (see cpu_decoder.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <vector>

// The decoder layers of a pre-norm SwiGLU model (RMSNorm, fused QKV, RoPE, paged attention,
// O, RMSNorm, fused gate/up, SiLU * up, down) over float32 rows and float32 KV pools, layer after
// layer, with the same native ops in the same order as the Python loop over
// DecoderLayer.forward_fused with NativeCascadeBackend.forward_qkv (so the same results, bit for
// bit): no bias, q/k norm, window or residual multiplier.
//
// x [T, H] float32 is the residual stream, updated in place; pending (or None) the MLP
// output not yet added to it (added by the first layer's input norm). Per layer i: norms[2i],
// norms[2i + 1] the input and post-attention RMSNorm weights with eps[2i], eps[2i + 1];
// linears[4i .. 4i + 3] qkv, o, gate_up, down with kinds[...] (-1: a float32 weight packed by
// pack_f32_weight, run by f32_gemm; else a GGML type id of raw rows, run by quant_linear with
// int8_rows[...]); k_caches[i], v_caches[i] the layer's pools. heads = (Hq, Hkv, D); cos, sin
// the float32 RoPE tables [T, D]; out_slots and the attention arguments as paged_attention_f32
// takes them. Returns the last layer's MLP output (pending for the final norm). team: run the
// layers in one OpenMP parallel region (cpu_decoder.cpp); only for 1 <= T <= team_rows_max()
// rows, every linear raw GGML rows that run at T rows either with int8 activations (a quant_dot
// type, T <= int8_rows) or on quant_gemm_into's decode path (AVX2 builds), every row of x a
// request's, all layers' pools alike; the same results as without it. terms: the int8
// activations' terms (quant_gemm_q8_into's: 1, or 2 at T <= 4).
at::Tensor decoder_layers_f32(at::Tensor x, const std::optional<at::Tensor>& pending,
                              const std::vector<at::Tensor>& norms, const std::vector<double>& eps,
                              const std::vector<at::Tensor>& linears,
                              const std::vector<int64_t>& kinds,
                              const std::vector<int64_t>& int8_rows,
                              const std::vector<int64_t>& heads, const at::Tensor& cos,
                              const at::Tensor& sin, std::vector<at::Tensor> k_caches,
                              std::vector<at::Tensor> v_caches, const at::Tensor& out_slots,
                              const at::Tensor& page_table, const std::vector<int64_t>& prefix_lens,
                              const std::vector<int64_t>& extend_lens,
                              const std::vector<int64_t>& extend_starts, double sm_scale,
                              const std::vector<int64_t>& group_members,
                              const std::vector<int64_t>& group_offsets,
                              const std::vector<int64_t>& group_shared, bool team,
                              int64_t terms = 1);

// The most rows a team step takes (8 where int8 activations or the AVX2 decode path serve).
int64_t team_rows_max();
// The most rows of float activations quant_gemm_into's decode path takes (0: none in this build).
int64_t quant_decode_rows();

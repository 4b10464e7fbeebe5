// Python bindings of radixkv's native CPU kernels (built by radixkv/model/native.py).
#include <torch/extension.h>

#include "cpu_attention.h"
#include "cpu_fused.h"
#include "cpu_kv_store.h"
#include "cpu_linear.h"
#include "cpu_sample.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention,
        "Paged attention over the KV pool for a step's decodes and extends (bf16, CPU)");
  m.def("has_fast_path", &has_fast_path, "Whether the AVX512-BF16 path serves this head dim");
  m.def("amx_attention_available", &amx_attention_available,
        "Whether paged_attention can run row tiles on AMX (oneDNN brgemm) here");
  m.def("set_amx_attention", &set_amx_attention,
        "Turn paged_attention's AMX items on or off; returns the previous setting");
  m.def("amx_attention_items", &amx_attention_items,
        "How many paged_attention work items this process has run on AMX");
  m.def("paged_attention_f32", &paged_attention_f32,
        "Paged attention, float32 math over float32/bf16/fp16 pools, shared-prefix groups");
  m.def("kernel_isa", []() { return std::string(f32_kernel_isa()); },
        "The ISA level this build was compiled for");
  m.def("rms_norm", &rms_norm, "RMSNorm of bf16 rows (float32 math)");
  m.def("add_rms_norm", &add_rms_norm, "residual += x in place, then RMSNorm of the residual");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a [rows, 2 * n] bf16 tensor");
  m.def("sample_rows", &sample_rows,
        "Inverse-CDF draw per row of float32 logits at a temperature (the sampler's plain rows)");
  m.def("argmax_rows", &argmax_rows,
        "torch.argmax(logits, -1) of contiguous float32 rows, rows in parallel");
  m.def("apply_token_bitmask_", &apply_token_bitmask_,
        "logits[r, j] = -inf where bit j of bitmask[r] is 0, r in rows (xgrammar's layout), in place");
  m.def("hadamard_rows", &hadamard_rows,
        "x H * scale over the last dim (kv_quant.hadamard's +-1 block Hadamard), float32/bf16");
  m.def("hadamard_rows_", &hadamard_rows_, "hadamard_rows in place");
  m.def("rope_hadamard_", &rope_hadamard_,
        "In place on bf16 rows: RoPE on the first rope_heads heads, then x H on the first heads "
        "(the bits of rope_ then hadamard_rows): the fused QKV output in the stored basis of "
        "rotated KV pages");
  m.def("store_kv_quant_", &store_kv_quant_,
        "Quantize k, v rows as kv_quant.quantize does and write them with their scales to slots");
  m.def("store_kv_", &store_kv_,
        "Copy k, v token rows [T, Hkv, D] to slots of same-dtype caches (any token stride)");
  m.def("copy_pages_", &copy_pages_,
        "Copy page src[i] to dst[i] in every cache of a list (one shape and dtype, contiguous)");
  m.def("has_bf16_gemm", &has_bf16_gemm, "Whether this build has the AVX512-BF16 GEMM");
  m.def("has_f32_gemm", &has_f32_gemm, "Whether this build has the float32 GEMM (AVX2/AVX-512)");
  m.def("f32_gemm_cols", &f32_gemm_cols, "Output columns per packed float32 block");
  m.def("bf16_gemm_block", &bf16_gemm_block,
        "(output columns, inputs per step) of a packed bf16 block: out_features and in_features "
        "must be multiples of them");
  m.def("pack_bf16_weight", &pack_bf16_weight,
        "W [N, K] bf16 -> [N / 16, K / 2, 32], the layout bf16_gemm reads");
  m.def("bf16_gemm", &bf16_gemm, "x [M, K] W^T for bf16 rows, W from pack_bf16_weight");
  m.def("pack_f32_weight", &pack_f32_weight,
        "W [N, K] float32 -> [N / cols, K, cols], the layout f32_gemm reads");
  m.def("f32_gemm", &f32_gemm, "x [M, K] W^T for float32 rows, W from pack_f32_weight");
  m.def("rope_", &rope_, "In-place rotate-half RoPE on the first heads of each bf16 row");
}

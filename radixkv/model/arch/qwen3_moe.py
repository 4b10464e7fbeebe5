"""Qwen3-MoE: Qwen3's attention (RMSNorm on each q and k head, ``attention_bias`` on q, k, v and
o; a sliding window on every layer where ``use_sliding_window``) with routed experts
(:mod:`radixkv.model.moe`) in place of the MLP: ``num_experts`` experts of width
``moe_intermediate_size``, the top ``num_experts_per_tok`` of the router's softmax, their weights
renormalised where ``norm_topk_prob``. Layer ``i`` routes where ``(i + 1) %
decoder_sparse_step == 0`` and ``i`` is not in ``mlp_only_layers``; the others run a dense MLP
of width ``intermediate_size``. ``output_router_logits`` and the auxiliary loss are training
only and ignored."""

from __future__ import annotations

from functools import partial
from typing import Any

from radixkv.model.arch.common import base_config, layer_windows_from_types, llama_biases
from radixkv.model.arch.experts import EXPERT_COUNTS, expert_features, map_sparse
from radixkv.model.model_config import ModelConfig

MODEL_TYPES = ("qwen3_moe",)


def read_config(hf: Any) -> ModelConfig:
    n = int(hf.num_hidden_layers)
    dense = {int(i) for i in getattr(hf, "mlp_only_layers", None) or ()}
    step = int(getattr(hf, "decoder_sparse_step", 1) or 1)
    sparse = [i not in dense and (i + 1) % step == 0 for i in range(n)]
    return base_config(
        hf,
        "qwen3_moe",
        computed=EXPERT_COUNTS,
        qk_norm="head",
        **llama_biases(hf),
        layer_windows=layer_windows_from_types(hf, "qwen3_moe"),
        **expert_features(
            hf,
            "qwen3_moe",
            sparse,
            int(hf.moe_intermediate_size),
            bool(getattr(hf, "norm_topk_prob", False)),
        ),
    )


#: dense layers as Llama names them; sparse ones' experts ``mlp.experts.{e}.{gate,up,down}_proj``
map_weights = partial(map_sparse, blocks=("mlp",), names=("gate_proj", "up_proj", "down_proj"))

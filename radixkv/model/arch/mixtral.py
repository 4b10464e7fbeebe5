"""Mixtral: Mistral's layer (a sliding window on every layer where ``sliding_window`` is set)
with routed experts (:mod:`radixkv.model.moe`) in place of every MLP: ``num_local_experts``
experts of width ``intermediate_size``, the top ``num_experts_per_tok`` of the router's softmax,
their weights renormalised to sum to 1. ``router_jitter_noise`` (training only),
``output_router_logits`` and the auxiliary loss are ignored."""

from __future__ import annotations

from functools import partial
from typing import Any

from radixkv.model.arch.common import base_config, layer_windows_from_types
from radixkv.model.arch.experts import EXPERT_COUNTS, expert_features, map_sparse
from radixkv.model.model_config import ModelConfig

MODEL_TYPES = ("mixtral",)


def read_config(hf: Any) -> ModelConfig:
    n = int(hf.num_hidden_layers)
    return base_config(
        hf,
        "mixtral",
        computed=EXPERT_COUNTS,
        layer_windows=layer_windows_from_types(hf, "mixtral"),
        **expert_features(hf, "mixtral", [True] * n, int(hf.intermediate_size), True),
    )


#: the experts as saved (``block_sparse_moe.experts.{e}.w1/w3/w2``: gate, up, down) or as
#: transformers 5.x's modules hold them (``mlp.experts``, fused)
map_weights = partial(map_sparse, blocks=("block_sparse_moe", "mlp"), names=("w1", "w3", "w2"))

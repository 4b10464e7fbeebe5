"""Qwen3: Llama's layer with an RMSNorm over each q and k head before RoPE (``q_norm``,
``k_norm``); ``attention_bias`` on q, k, v and o."""

from __future__ import annotations

from typing import Any

from radixkv.model.arch.common import (
    base_config,
    layer_windows_from_types,
    llama_biases,
    map_standard,
)
from radixkv.model.model_config import ModelConfig

MODEL_TYPES = ("qwen3",)


def read_config(hf: Any) -> ModelConfig:
    return base_config(
        hf,
        "qwen3",
        qk_norm="head",
        **llama_biases(hf),
        layer_windows=layer_windows_from_types(hf, "qwen3"),
    )


#: every layer as Llama names it
map_weights = map_standard

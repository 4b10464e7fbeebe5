"""Llama 2 / 3.x (and SmolLM2, which is a Llama): RoPE with ``linear`` or ``llama3`` scaling,
grouped-query attention, SwiGLU; ``attention_bias`` puts biases on q, k, v and o, ``mlp_bias``
on the MLP."""

from __future__ import annotations

from typing import Any

from radixkv.model.arch.common import (
    base_config,
    layer_windows_from_types,
    llama_biases,
    map_standard,
)
from radixkv.model.model_config import ModelConfig

MODEL_TYPES = ("llama",)


def read_config(hf: Any) -> ModelConfig:
    return base_config(
        hf,
        "llama",
        **llama_biases(hf),
        layer_windows=layer_windows_from_types(hf, "llama"),
    )


#: every layer as Llama names it
map_weights = map_standard

"""Qwen2 / Qwen2.5: Llama's layer with biases on q, k and v (none on o); sliding-window layers
where ``use_sliding_window`` makes ``layer_types`` say so."""

from __future__ import annotations

from typing import Any

from radixkv.model.arch.common import base_config, layer_windows_from_types, map_standard
from radixkv.model.model_config import ModelConfig

MODEL_TYPES = ("qwen2",)


def read_config(hf: Any) -> ModelConfig:
    return base_config(
        hf, "qwen2", attention_bias=True, layer_windows=layer_windows_from_types(hf, "qwen2")
    )


#: every layer as Llama names it
map_weights = map_standard

"""Mistral: Llama's layer with a sliding window (``sliding_window``) on every layer."""

from __future__ import annotations

from typing import Any

from radixkv.model.arch.common import base_config, layer_windows_from_types, map_standard
from radixkv.model.model_config import ModelConfig

MODEL_TYPES = ("mistral",)


def read_config(hf: Any) -> ModelConfig:
    return base_config(hf, "mistral", layer_windows=layer_windows_from_types(hf, "mistral"))


#: every layer as Llama names it
map_weights = map_standard

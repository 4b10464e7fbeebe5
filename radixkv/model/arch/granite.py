"""Granite 3: Llama's layer with four multipliers: ``embedding_multiplier`` on the embeddings,
``attention_multiplier`` as the softmax scale, ``residual_multiplier`` on each sub-layer's output
before its residual add, and the logits divided by ``logits_scaling``."""

from __future__ import annotations

from typing import Any

from radixkv.model.arch.common import base_config, llama_biases, map_standard
from radixkv.model.model_config import ModelConfig

MODEL_TYPES = ("granite",)


def read_config(hf: Any) -> ModelConfig:
    return base_config(
        hf,
        "granite",
        **llama_biases(hf),
        embedding_scale=float(getattr(hf, "embedding_multiplier", 1.0)),
        attention_scale=float(getattr(hf, "attention_multiplier", 1.0)),
        residual_multiplier=float(getattr(hf, "residual_multiplier", 1.0)),
        logits_divisor=float(getattr(hf, "logits_scaling", 1.0)),
    )


#: every layer as Llama names it
map_weights = map_standard

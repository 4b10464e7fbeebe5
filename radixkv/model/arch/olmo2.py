"""OLMo 2: norms on the outputs instead of the inputs (``post_attention_layernorm`` on the
attention's output, ``post_feedforward_layernorm`` on the MLP's, none before either), and an
RMSNorm over the whole q and k projections before RoPE."""

from __future__ import annotations

from typing import Any

from radixkv.model.arch.common import base_config, llama_biases, map_standard
from radixkv.model.model_config import ModelConfig

MODEL_TYPES = ("olmo2",)


def read_config(hf: Any) -> ModelConfig:
    return base_config(
        hf,
        "olmo2",
        qk_norm="proj",
        norm_layout="post",
        **llama_biases(hf),
    )


#: every layer as Llama names it
map_weights = map_standard

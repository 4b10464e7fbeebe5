"""One module per architecture: each reads its transformers config into a
:class:`~radixkv.model.model_config.ModelConfig` (refusing, by name, what radixkv cannot serve
exactly) and maps its checkpoint's weights into radixkv's layout (:mod:`.common`). Adding a
family means a module here and a line in :data:`ARCHITECTURES`, not an edit of the decoder.

>>> config = read_config(hf_config)                 # UnsupportedModelError names the field
>>> weights = map_weights(config, state_dict, dtype, device)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

import torch

from radixkv.model.arch import (
    gemma3,
    granite,
    llama,
    mistral,
    mixtral,
    olmo2,
    phi3,
    qwen2,
    qwen3,
    qwen3_moe,
    smollm3,
)
from radixkv.model.arch.common import UnsupportedModelError, WeightTaker, refuse
from radixkv.model.model_config import ModelConfig

__all__ = ["ARCHITECTURES", "UnsupportedModelError", "map_weights", "read_config"]

#: ``model_type`` -> the module that serves it.
ARCHITECTURES: dict[str, ModuleType] = {
    t: m
    for m in (
        llama,
        mistral,
        qwen2,
        qwen3,
        gemma3,
        phi3,
        granite,
        smollm3,
        olmo2,
        qwen3_moe,
        mixtral,
    )
    for t in m.MODEL_TYPES
}


def architecture(hf_config: Any) -> ModuleType:
    model_type = getattr(hf_config, "model_type", None) or "llama"
    module = ARCHITECTURES.get(model_type)
    if module is None:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported by radixkv (supported: "
            f"{', '.join(sorted(ARCHITECTURES))})"
        )
    return module


def read_config(hf_config: Any) -> ModelConfig:
    """The :class:`ModelConfig` of a transformers config; raises
    :class:`UnsupportedModelError` naming the ``model_type`` or field radixkv cannot serve."""
    return architecture(hf_config).read_config(hf_config)


def map_weights(
    config: ModelConfig,
    state_dict: Mapping[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    sink: Callable[[str, torch.Tensor], None] | None = None,
) -> dict[str, torch.Tensor]:
    """The checkpoint's weights in radixkv's layout and ``dtype``; raises
    :class:`UnsupportedModelError` naming a weight nothing would read. With ``sink`` each
    weight goes to ``sink(name, tensor)`` as soon as it is made, and the dict returned is
    empty."""
    taker = WeightTaker(config.model_type, state_dict, dtype, device, config, sink)
    module = ARCHITECTURES.get(config.model_type)
    if module is None:
        raise refuse(config.model_type, "this model_type")
    return module.map_weights(config, taker)

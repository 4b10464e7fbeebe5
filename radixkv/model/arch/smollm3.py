"""SmolLM3: Llama's layer where ``no_rope_layers[i] == 0`` marks a NoPE layer (no rotary
embedding on its q and k)."""

from __future__ import annotations

from typing import Any

from radixkv.model.arch.common import (
    base_config,
    layer_windows_from_types,
    llama_biases,
    map_standard,
    refuse,
)
from radixkv.model.model_config import ModelConfig

MODEL_TYPES = ("smollm3",)


def read_config(hf: Any) -> ModelConfig:
    n = int(hf.num_hidden_layers)
    flags = getattr(hf, "no_rope_layers", None)
    if flags is None:
        interval = getattr(hf, "no_rope_layer_interval", None)
        flags = [int((i + 1) % interval != 0) for i in range(n)] if interval else [1] * n
    if len(flags) != n:
        raise refuse("smollm3", f"no_rope_layers of {len(flags)} entries for {n} layers")
    return base_config(
        hf,
        "smollm3",
        **llama_biases(hf),
        layer_rope=["global" if f else "none" for f in flags],
        layer_windows=layer_windows_from_types(hf, "smollm3"),
    )


#: every layer as Llama names it
map_weights = map_standard

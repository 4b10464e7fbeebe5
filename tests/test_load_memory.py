"""What the load holds at its peak: the decoder's plain weights are freed as their packed copies
are made, not at the end of the load, and each layer is packed before the next is read."""

from __future__ import annotations

import weakref

import pytest
import torch
from architectures import tiny_model
from torch import nn

from bench.tiny_model import byte_level_hf_tokenizer
from radixkv.model import linear, placement
from radixkv.model.linear import native_gemm_module, packed_linear_supported, prepack_linears
from radixkv.model.loader import load_model
from radixkv.model.runner import ModelRunner

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")

needs_native_f32 = pytest.mark.skipif(
    not packed_linear_supported(torch.float32, "cpu")
    or native_gemm_module(torch.zeros(8, 8)) is None,
    reason="no native float32 GEMM here: every linear keeps its plain weight",
)


@needs_native_f32
def test_prepack_frees_each_released_weight_before_packing_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("RADIXKV_KEEP_PLAIN_WEIGHTS", raising=False)
    layer = nn.Module()
    for name in PROJECTIONS:
        setattr(layer, name, nn.Linear(16, 32, bias=False).requires_grad_(False))
    plain = [weakref.ref(getattr(layer, name).weight) for name in PROJECTIONS]
    alive: list[int] = []

    class Spy(linear.PackedLinear):
        def __init__(self, lin: nn.Linear, *args: object, **kwargs: object) -> None:
            alive.append(sum(ref() is not None for ref in plain))
            super().__init__(lin, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(linear, "PackedLinear", Spy)
    assert prepack_linears(layer, release=PROJECTIONS) == 4
    assert alive == [4, 3, 2, 1]  # each released plain weight died with its nn.Linear
    assert all(ref() is None for ref in plain)
    assert all(getattr(layer, name).weight.is_meta for name in PROJECTIONS)


@pytest.mark.skipif(
    not packed_linear_supported(torch.float32, "cpu"), reason="no packed linears here"
)
def test_each_layer_is_packed_before_the_next_layers_weights_are_read(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiny_model("qwen3").save_pretrained(tmp_path)
    byte_level_hf_tokenizer().save_pretrained(tmp_path)
    place = placement.WeightPlacer.__call__
    unpacked_before: list[int] = []

    def spy(self: placement.WeightPlacer, name: str, tensor: torch.Tensor) -> None:
        if name.startswith("layers.") and name.endswith(".qkv_proj.weight"):
            i = int(name.split(".")[1])  # layer i's first weight: every earlier layer packed?
            layers = self.model.layers[:i]
            unpacked_before.append(sum(type(m) is nn.Linear for m in layers.modules()))
        place(self, name, tensor)

    monkeypatch.setattr(placement.WeightPlacer, "__call__", spy)
    runner = ModelRunner(load_model(str(tmp_path), hf_model=False), num_pages=2, page_size=16)
    assert unpacked_before == [0] * runner.config.num_layers

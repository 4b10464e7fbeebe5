"""What the load holds at its peak: the decoder's plain weights are freed as their packed copies
are made, not at the end of the load."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn

from radixkv.model import linear
from radixkv.model.linear import native_gemm_module, packed_linear_supported, prepack_linears

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

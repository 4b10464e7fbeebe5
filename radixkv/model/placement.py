"""Weights placed into radixkv's model as they are made, each decoder layer packed once whole.

The model is built on the meta device; :class:`WeightPlacer` puts each weight in its place as
the architecture module makes it (:func:`radixkv.model.arch.map_weights`' ``sink``) and, as soon
as a decoder layer has every weight, packs its linears (:func:`radixkv.model.linear.
prepack_linears`): a projection whose packed copy is all its GEMM reads drops its plain copy
before the next layer's weights are read. A streamed load (:mod:`radixkv.model.checkpoint`) then
holds the packed layers plus the one layer in flight, never the whole model in both layouts.

A tied head whose packed copy is all its GEMM reads is held once (:func:`pack_tied_head`): packed
from the embedding, the embedding gathering its rows from that copy
(:class:`~radixkv.model.linear.PackedEmbedding`).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from radixkv.model.linear import (
    PackedEmbedding,
    PackedLinear,
    packed_alone,
    packed_linear_supported,
    prepack_linears,
)

__all__ = ["DECODER_PROJECTIONS", "WeightPlacer", "pack_tied_head"]

#: the decoder layer's linears, which keep only their packed copy where that is all the GEMM reads
DECODER_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class WeightPlacer:
    """``placer(name, tensor)`` sets parameter ``name`` of ``model`` (built on the meta device)
    to ``tensor``; the layer ``layers.{i}`` it completes is packed then.

    Invariant: every name is placed at most once, and only a name the model has."""

    def __init__(self, model: nn.Module, model_type: str) -> None:
        self.model = model
        self.model_type = model_type
        self.names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        self.placed: set[str] = set()

    def __call__(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self.names:
            raise KeyError(f"weight {name!r} has no place in radixkv's {self.model_type}")
        if name in self.placed:
            raise KeyError(f"weight {name!r} given twice")
        module_name, _, attr = name.rpartition(".")
        module = self.model.get_submodule(module_name)
        setattr(module, attr, nn.Parameter(tensor, requires_grad=False))
        self.placed.add(name)
        parts = name.split(".")
        if parts[0] == "layers" and len(parts) > 2:
            layer = self.model.get_submodule(f"layers.{parts[1]}")
            if not any(p.is_meta for p in layer.parameters()):
                prepack_linears(layer, release=DECODER_PROJECTIONS)

    def missing(self) -> list[str]:
        """The model's parameters no weight was placed in (a head never given is the
        embedding's, tied)."""
        left = self.names - self.placed
        if "lm_head.weight" not in self.placed:
            left.discard("lm_head.weight")
        return sorted(left)


def pack_tied_head(model: nn.Module) -> bool:
    """Where ``model.lm_head`` (an ``nn.Linear``) is tied to ``model.embed_tokens`` and its
    packed copy is all its GEMM reads: the head packed with its plain weight released, the
    embedding a :class:`~radixkv.model.linear.PackedEmbedding` over it; True. Else nothing
    changes (``RADIXKV_KEEP_PLAIN_WEIGHTS=1`` too) and False."""
    head = model.lm_head
    w = head.weight
    if type(head) is not nn.Linear or w is not model.embed_tokens.weight:
        return False
    if os.environ.get("RADIXKV_KEEP_PLAIN_WEIGHTS") == "1":
        return False
    if not packed_linear_supported(w.dtype, w.device) or not packed_alone(w):
        return False
    del w
    model.lm_head = PackedLinear(head, release_weight=True)
    model.embed_tokens = PackedEmbedding(model.lm_head)
    return True

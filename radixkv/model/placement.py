"""Weights placed into radixkv's model as they are made, each decoder layer packed once whole.

The model is built on the meta device; :class:`WeightPlacer` puts each weight in its place as
the architecture module makes it (:func:`radixkv.model.arch.map_weights`' ``sink``) and, as soon
as a decoder layer has every weight, packs its linears (:func:`radixkv.model.linear.
prepack_linears`): a projection whose packed copy is all its GEMM reads drops its plain copy
before the next layer's weights are read. A streamed load (:mod:`radixkv.model.checkpoint`) then
holds the packed layers plus the one layer in flight, never the whole model in both layouts.

A tied head whose packed copy is all its GEMM reads is held once (:func:`pack_tied_head`): packed
from the embedding, the embedding gathering its rows from that copy
(:class:`~radixkv.model.linear.PackedEmbedding`). Where the placer owns the tensors (a streamed
checkpoint), no weight has both layouts held whole, even for a moment
(:mod:`radixkv.model.repack`), and the heap's freed pages go back to the OS after each layer
(:func:`trim_heap`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from collections.abc import Callable

import torch
from torch import nn

from radixkv.model.int8_linear import quantize_linears
from radixkv.model.linear import (
    PackedEmbedding,
    PackedLinear,
    packed_alone,
    packed_linear_supported,
    prepack_linears,
)
from radixkv.model.repack import memory_kind

__all__ = ["DECODER_PROJECTIONS", "WeightPlacer", "pack_tied_head", "trim_heap"]

#: the decoder layer's linears, which keep only their packed copy where that is all the GEMM reads
DECODER_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class WeightPlacer:
    """``placer(name, tensor)`` sets parameter ``name`` of ``model`` (built on the meta device)
    to ``tensor``; the layer ``layers.{i}`` it completes is packed then.

    ``owned``: the tensors given are the placer's alone (a checkpoint read tensor by tensor), so
    a released projection is packed without both its layouts held whole
    (:mod:`radixkv.model.repack`); one whose memory another weight placed shares is not.
    ``quantization="int8"``: a completed layer's projections are quantized instead
    (:func:`radixkv.model.int8_linear.quantize_linears`), their float weights freed.

    Invariant: every name is placed at most once, and only a name the model has."""

    def __init__(
        self,
        model: nn.Module,
        model_type: str,
        owned: bool = False,
        quantization: str | None = None,
    ) -> None:
        self.model = model
        self.quantization = quantization
        self.model_type = model_type
        self.owned = owned
        self.names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        self.placed: set[str] = set()
        self._storages: dict[int, int] = {}  # storage address -> weights placed in it

    def __call__(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self.names:
            raise KeyError(f"weight {name!r} has no place in radixkv's {self.model_type}")
        if name in self.placed:
            raise KeyError(f"weight {name!r} given twice")
        module_name, _, attr = name.rpartition(".")
        module = self.model.get_submodule(module_name)
        setattr(module, attr, nn.Parameter(tensor, requires_grad=False))
        self.placed.add(name)
        at = tensor.untyped_storage().data_ptr()
        self._storages[at] = self._storages.get(at, 0) + 1
        parts = name.split(".")
        if parts[0] == "layers" and len(parts) > 2:
            layer = self.model.get_submodule(f"layers.{parts[1]}")
            if not any(p.is_meta for p in layer.parameters()):
                if self.quantization == "int8":
                    quantize_linears(layer, DECODER_PROJECTIONS)
                prepack_linears(layer, release=DECODER_PROJECTIONS, owned=self.owned_kind)
                trim_heap()  # plain copies just freed: the next layer's must not add to them

    def owned_kind(self, weight: torch.Tensor) -> str | None:
        """Where ``weight`` lives (:func:`~radixkv.model.repack.memory_kind`) if it is the
        placer's alone, else None."""
        if not self.owned or self._storages.get(weight.untyped_storage().data_ptr(), 0) != 1:
            return None
        return memory_kind(weight)

    def missing(self) -> list[str]:
        """The model's parameters no weight was placed in (a head never given is the
        embedding's, tied)."""
        left = self.names - self.placed
        if "lm_head.weight" not in self.placed:
            left.discard("lm_head.weight")
        return sorted(left)


def pack_tied_head(
    model: nn.Module, owned: Callable[[torch.Tensor], str | None] | None = None
) -> bool:
    """Where ``model.lm_head`` (an ``nn.Linear``) is tied to ``model.embed_tokens`` and its
    packed copy is all its GEMM reads: the head packed with its plain weight released (where
    ``owned(weight)`` says it is nobody else's, without both layouts held whole), the embedding
    a :class:`~radixkv.model.linear.PackedEmbedding` over it; True. Else nothing changes
    (``RADIXKV_KEEP_PLAIN_WEIGHTS=1`` too) and False."""
    head = model.lm_head
    w = head.weight
    if type(head) is not nn.Linear or w is not model.embed_tokens.weight:
        return False
    if os.environ.get("RADIXKV_KEEP_PLAIN_WEIGHTS") == "1":
        return False
    if not packed_linear_supported(w.dtype, w.device) or not packed_alone(w):
        return False
    kind = owned(w) if owned is not None else None
    del w
    model.lm_head = PackedLinear(head, release_weight=True, owned=kind)
    model.embed_tokens = PackedEmbedding(model.lm_head)
    return True


_malloc_trim: object = None


def trim_heap() -> bool:
    """Give the C heap's free pages back to the OS (glibc's ``malloc_trim(0)``): glibc keeps
    freed memory mapped, so the plain copies a load frees would otherwise stay in its resident
    set. False (nothing done) off glibc."""
    global _malloc_trim
    if _malloc_trim is None:
        _malloc_trim = False
        if sys.platform.startswith("linux"):
            with contextlib.suppress(OSError, AttributeError):  # glibc only (musl has none)
                _malloc_trim = ctypes.CDLL(None).malloc_trim
    if _malloc_trim is False:
        return False
    _malloc_trim(0)  # type: ignore[operator]
    return True

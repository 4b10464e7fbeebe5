"""The decoder layers in one native call (``decoder_layers_f32``), where a model allows it.

A batch-1 decode step of a small model is mostly dispatch: per layer ~13 native ops called from
Python (norms, four linears, RoPE, the K/V store, the attention kernel, SiLU * up). The native
``decoder_layers_f32`` (radixkv/model/csrc/cpu_decoder.cpp) runs the same ops in the same order
from one C++ loop, so its outputs equal the Python loop's bit for bit and only the dispatch
between the ops goes (tests/test_decoder_stack.py compares the two).

:func:`decoder_stack` says whether a model's layers are all of the kind it computes and, if so,
gathers their weights once: pre-norm SwiGLU layers (the fused path's own condition) with no q/k
norm, sliding window, residual multiplier, experts or bias, one RoPE kind, every linear a
float32 :class:`~radixkv.model.linear.PackedLinear` on radixkv's GEMM or a one-segment
:class:`~radixkv.model.quant_linear.QuantLinear`, all from the attention backend's native build.
A step runs it when its rows and KV pools are float32 and the backend's ``forward_qkv`` is the
three native calls the loop reproduces (:attr:`AttentionBackend.f32_layers_native`).

A decode's few rows over GGUF-block linears (every linear a one-segment ``QuantLinear``
multiplying those rows with int8 activations, or on the float decode path of AVX2 builds) run
as a *team*: the layers inside one OpenMP parallel region, each thread its share of every
linear's rows and attention items, barriers between them, instead of ~5 parallel regions and
~13 ATen calls a layer (:attr:`DecoderStack.team_rows`; the same results bit for bit).

``RADIXKV_DECODER_STACK=0`` (read when the stack is gathered) keeps the Python loop: an A/B
switch, and what a profile of the per-layer parts needs (bench/bench_step_breakdown.py turns
it off through ``LlamaModel.use_decoder_stack``). ``RADIXKV_DECODER_TEAM=0`` (read then too)
keeps the stack off the team path.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["DecoderStack", "LayersKey", "StackCache", "decoder_stack", "layers_changed"]

#: bumped by :func:`layers_changed` whenever an attribute of a decoder layer is set (what makes
#: its parts afresh): a :class:`LayersKey` taken before no longer matches
_generation = [0]


def layers_changed() -> None:
    """Note that some decoder layer's attributes changed (``DecoderLayer.__setattr__``)."""
    _generation[0] += 1


class LayersKey:
    """What a model's layers were when something was derived from them: the layer objects (by
    identity) and the attribute generation. :meth:`matches` is a few C-level comparisons, not a
    walk over each layer's parts (~30 Python calls a step)."""

    __slots__ = ("generation", "layers")

    def __init__(self, layers: Sequence[Any] = ()) -> None:
        self.generation = _generation[0]
        self.layers = tuple(layers)

    def matches(self, layers: Sequence[Any]) -> bool:
        """Whether ``layers`` are the same objects, with no attribute of any layer set since."""
        now = tuple(layers)
        return (
            self.generation == _generation[0]
            and len(now) == len(self.layers)
            and all(map(operator.is_, now, self.layers))
        )


@dataclass(frozen=True)
class DecoderStack:
    """The layers' arguments of ``decoder_layers_f32``, gathered once.

    Invariant: ``parts`` are the layers' ``fused_parts()`` tuples it was gathered from; the
    model gathers it again when any layer's differ (a layer's attribute was set)."""

    module: str
    parts: tuple[Any, ...]
    norms: list[torch.Tensor]
    eps: list[float]
    linears: list[torch.Tensor]
    kinds: list[int]
    int8_rows: list[int]
    #: int8 terms a row of x where a linear runs with int8 activations (every linear's alike)
    terms: int
    heads: list[int]
    rope_kind: str
    sm_scale: float
    #: the most rows a step may have to run as a team (module docstring): the fewest rows any
    #: linear's decode paths take (int8 activations' or the float one), where every linear is
    #: GGUF blocks; 0: never
    team_rows: int = 0

    def run(
        self,
        ops: Any,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        meta: Any,
    ) -> torch.Tensor:
        """Every layer on ``x`` (the residual stream, updated in place); returns the last
        layer's MLP output, not yet added (the final norm adds it)."""
        rows = x.shape[0]
        team = 0 < rows <= self.team_rows and sum(meta.extend_lens) == rows
        return ops.decoder_layers_f32(
            x,
            None,
            self.norms,
            self.eps,
            self.linears,
            self.kinds,
            self.int8_rows,
            self.heads,
            cos,
            sin,
            k_caches,
            v_caches,
            meta.out_slots,
            meta.page_table,
            meta.prefix_lens,
            meta.extend_lens,
            meta.extend_starts,
            self.sm_scale,
            *meta.group_args,
            team,
            self.terms,
        )


def enabled() -> bool:
    """``RADIXKV_DECODER_STACK`` is not ``0``."""
    return os.environ.get("RADIXKV_DECODER_STACK", "1") != "0"


def team_enabled() -> bool:
    """``RADIXKV_DECODER_TEAM`` is not ``0``."""
    return os.environ.get("RADIXKV_DECODER_TEAM", "1") != "0"


def decoder_stack(
    layers: Sequence[nn.Module], parts: Sequence[Any], decode_rows: int = 0
) -> DecoderStack | None:
    """The stack of ``layers`` (``DecoderLayer``\\ s with their ``fused_parts()`` ``parts``),
    or None where any layer is not of the kind ``decoder_layers_f32`` computes (module
    docstring) or the switch is off. ``decode_rows``: the most float rows the native build's
    GGUF decode path takes (its ``quant_decode_rows()``; 0: none)."""
    if not layers or not enabled():
        return None
    first = layers[0]
    norms: list[torch.Tensor] = []
    eps: list[float] = []
    linears: list[torch.Tensor] = []
    kinds: list[int] = []
    int8_rows: list[int] = []
    modules: set[str] = set()
    terms: set[int] = set()
    for layer, (norm_in, post, qkv, o, gate_up, down) in zip(layers, parts, strict=True):
        if (
            layer.q_norm is not None
            or layer.k_norm is not None
            or layer.window is not None
            or layer.moe is not None
            or layer.residual_multiplier != 1.0
            or layer.rope_kind != first.rope_kind
            or layer.sm_scale != first.sm_scale
            or (layer.num_heads, layer.num_kv_heads, layer.head_dim)
            != (first.num_heads, first.num_kv_heads, first.head_dim)
        ):
            return None
        for norm in (norm_in, post):
            if norm.weight.dtype != torch.float32:
                return None
            norms.append(norm.weight)
            eps.append(float(norm.eps))
        for lin in (qkv, o, gate_up, down):
            entry = lin.stack_entry() if hasattr(lin, "stack_entry") else None
            if entry is None:
                return None
            module, weight, kind, rows, lin_terms = entry
            modules.add(module)
            if rows:
                terms.add(lin_terms)
            linears.append(weight)
            kinds.append(kind)
            int8_rows.append(rows)
    if len(modules) != 1 or len(terms) > 1:
        return None
    team_rows = 0
    if team_enabled() and all(k >= 0 for k in kinds):
        team_rows = min(max(rows, decode_rows) for rows in int8_rows)
    return DecoderStack(
        module=modules.pop(),
        parts=tuple(parts),
        norms=norms,
        eps=eps,
        linears=linears,
        kinds=kinds,
        int8_rows=int8_rows,
        terms=terms.pop() if terms else 1,
        heads=[first.num_heads, first.num_kv_heads, first.head_dim],
        rope_kind=first.rope_kind,
        sm_scale=float(first.sm_scale),
        team_rows=team_rows,
    )


class StackCache:
    """A model's stack for the steps that can run it, gathered once and again after its layers
    change (other layer objects, or an attribute of one set: ``DecoderLayer`` makes its parts
    afresh then and calls :func:`layers_changed`).

    Invariant: ``stack`` is ``decoder_stack(layers, parts)`` of the layers ``key`` names and
    their parts as they are now, or nothing gathered yet (``key`` None)."""

    def __init__(self) -> None:
        self.key: LayersKey | None = None
        self.stack: DecoderStack | None = None

    def for_step(
        self,
        model: Any,
        ops: Any,
        backend: Any,
        x: torch.Tensor,
        k_caches: list[torch.Tensor],
        windows: dict[int, Any],
    ) -> DecoderStack | None:
        """``model``'s layers as one native call where this step allows it: float32 rows and
        pools, a backend whose ``forward_qkv`` the native loop reproduces
        (``f32_layers_native``), no window plan, ``model.use_decoder_stack``, and ``ops`` the
        native build the stack's linears were gathered from."""
        if (
            not model.use_decoder_stack
            or windows
            or x.dtype != torch.float32
            or not backend.f32_layers_native
            or not k_caches
            or k_caches[0].dtype != torch.float32
        ):
            return None
        layers = model.layers
        if self.key is None or not self.key.matches(layers):
            key = LayersKey(layers)
            parts = tuple(layer.fused_parts() for layer in key.layers)
            decode_rows = int(getattr(ops, "quant_decode_rows", lambda: 0)())
            self.key, self.stack = key, decoder_stack(list(key.layers), parts, decode_rows)
        stack = self.stack
        if stack is None or getattr(ops, "__name__", None) != stack.module:
            return None
        return stack

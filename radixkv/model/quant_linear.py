"""Linears and embeddings over GGUF block-quantized rows (``--quantization gguf``).

A GGUF tensor of a block-quantized ggml type stores each output row ``n`` of a weight ``W[N, K]``
as ``K / block`` blocks (``gguf.GGML_QUANT_SIZES``: Q8_0 34 bytes per 32 weights, Q4_0 18,
Q4_1 20, Q4_K 144 per 256, Q6_K 210 per 256): a row is a whole number of blocks, so rows can be
permuted, split and concatenated as raw bytes without touching a value. The quantized model *is*
the one with the dequantized weights (``gguf.quants.dequantize`` of those bytes, what
transformers' GGUF reader makes of the file): that is what the tests judge against a float64
forward of, so the only error beyond quantization's own is the product's arithmetic.

:class:`QuantLinear` holds one or more row *segments* ``(raw uint8 [n_i, row_bytes_i],
ggml_type_i)`` whose rows are the output rows in order (a fused q/k/v projection is the q, k
and v tensors' rows; gate/up the gate's then the up's), so a file whose q/k/v differ in type
(Q4_K_M puts Q6_K on some) still fuses. ``forward`` writes each segment's columns of one
``[M, N]`` output: through the native op ``quant_gemm_into`` (:mod:`radixkv.model.native`;
the weight dequantized in registers, never whole) where the build has it for that type, else by
the torch fallback (the segment dequantized per call by ``gguf.quants.dequantize``, then
``F.linear``: the same values, slow, with a one-time warning).

:class:`QuantEmbedding` gathers rows of the token embedding the same way
(``quant_dequantize_rows``, fallback: ``gguf.quants.dequantize`` of the selected rows); a tied
head is a :class:`QuantLinear` over the same raw tensor, held once.

Activations stay in the model's dtype (float32 or bfloat16); the output is in the input's.

Decode rows: a float32 input of at most ``quant_dot_max_rows()`` (8) rows through a segment of a
type in ``quant_dot_types()`` (Q4_0, Q4_1, Q8_0) runs ``quant_gemm_q8_into`` instead, which
quantizes x per 32-block to int8 (float32 scale) and multiplies with integer dot products, as
llama.cpp does (2-3x fewer instructions a weight than decoding the weight to float). That adds
x's quantization error (``sum_b (d_b / 2) sum |w|`` per output, radixkv/model/csrc/
cpu_quant_dot.cpp), so a model on it is held to the bf16 contract of tests/oracle.py, not
float32's. The environment variable ``RADIXKV_QUANT_ACTIVATIONS``, read when a layer is built,
chooses: ``float`` (the default: weights-only quantization, the float32 contract, every row
through ``quant_gemm_into``), ``int8`` (llama.cpp's way, opt-in: faster at 1-8 rows, but on
SmolLM2's Q4_1 file its logits missed the bf16 contract, 3.89x transformers-bf16's error on the
worst row where the contract allows 3x; tests/test_gguf_quantized.py keeps that as a strict xfail)
or ``int8x2`` (opt-in, 1-4 rows: x as two int8 terms, its codes and the codes of what they leave,
both products summed: x's error at most ``amax / 64516`` a block, below bfloat16's rounding, so
held to the bf16 contract, which it meets on SmolLM2; ~1.2-1.5x int8's kernel time, 0.5-0.7x the
float path's).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from functools import cache
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from radixkv.model.gguf_weights import block_shape, dequantize_rows, type_name

__all__ = [
    "QuantEmbedding",
    "QuantLinear",
    "activation_mode",
    "can_dequantize",
    "dot_types",
    "merge_segments",
    "native_types",
]

#: ``RADIXKV_QUANT_ACTIVATIONS``'s values (the module docstring)
ACTIVATION_MODES = ("float", "int8", "int8x2")
#: int8 terms per row of x in each mode that has them (``quant_gemm_q8_into``'s ``terms``)
_TERMS = {"int8": 1, "int8x2": 2}

log = logging.getLogger(__name__)
_warned: set[int] = set()


@cache
def can_dequantize(ggml_type: int) -> bool:
    """Whether ``gguf.quants.dequantize`` reads ``ggml_type`` (the torch fallback's need)."""
    import gguf

    _, size = block_shape(ggml_type)
    try:
        gguf.quants.dequantize(np.zeros((1, size), np.uint8), gguf.GGMLQuantizationType(ggml_type))
    except (NotImplementedError, ValueError, KeyError):
        return False
    return True


def _native() -> Any:
    from radixkv.model import native

    return native.load()


@cache
def native_types() -> frozenset[int]:
    """The ggml types the native build multiplies (``quant_gemm_types``; empty without it)."""
    module = _native()
    if module is None or not hasattr(module, "quant_gemm_types"):
        return frozenset()
    return frozenset(int(t) for t in module.quant_gemm_types())


@cache
def dot_types() -> tuple[frozenset[int], int]:
    """The ggml types ``quant_gemm_q8_into`` multiplies and the most rows it takes (empty, 0
    without the op)."""
    module = _native()
    if module is None or not hasattr(module, "quant_dot_types"):
        return frozenset(), 0
    return frozenset(int(t) for t in module.quant_dot_types()), int(module.quant_dot_max_rows())


def activation_mode() -> str:
    """``RADIXKV_QUANT_ACTIVATIONS`` (``float`` when unset); raises on another value."""
    mode = os.environ.get("RADIXKV_QUANT_ACTIVATIONS", "float")
    if mode not in ACTIVATION_MODES:
        raise ValueError(
            f"RADIXKV_QUANT_ACTIVATIONS={mode!r}: use one of {', '.join(ACTIVATION_MODES)}"
        )
    return mode


def _warn_fallback(ggml_type: int, what: str) -> None:
    if ggml_type not in _warned:
        _warned.add(ggml_type)
        log.warning(
            "%s %s: the native build has no kernel for it; dequantizing per call with "
            "gguf.quants (correct, slow)",
            type_name(ggml_type),
            what,
        )


def same_run(type_a: int, row_bytes_a: int, type_b: int, row_bytes_b: int) -> bool:
    """Whether two adjacent segments are held as one (:func:`merge_segments`): one ggml type
    and one row size. The GGUF loader applies it to the file's shapes to read a run into one
    tensor (radixkv/model/gguf_quantized.py)."""
    return type_a == type_b and row_bytes_a == row_bytes_b


def merge_segments(
    segments: Sequence[tuple[torch.Tensor, int]],
) -> list[tuple[torch.Tensor, int]]:
    """``segments`` with each run of adjacent segments of one ggml type (and row size) made one
    (their rows concatenated, in order): one kernel call a run instead of one a tensor (a
    fused q/k/v of one type is one product). A lone segment keeps its tensor (a tied head's rows
    stay the embedding's)."""
    runs: list[list[tuple[torch.Tensor, int]]] = []
    for raw, t in segments:
        last = runs[-1][0] if runs else None
        if (
            last is not None
            and last[0].dim() == raw.dim() == 2
            and same_run(last[1], last[0].shape[1], t, raw.shape[1])
        ):
            runs[-1].append((raw, t))
        else:
            runs.append([(raw, t)])
    return [
        run[0] if len(run) == 1 else (torch.cat([r for r, _ in run]), run[0][1]) for run in runs
    ]


class QuantLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` the rows of ``segments`` (``(raw, ggml_type)`` pairs,
    ``raw`` uint8 ``[n_i, row_bytes_i]``), concatenated: ``out_features = sum n_i``; adjacent
    segments of one type are held as one (:func:`merge_segments`).

    Invariants: every segment's rows dequantize to ``in_features`` values (whole blocks);
    ``kernels[i]`` is ``"native"`` (``quant_gemm_into``) or ``"dequantize"`` (the fallback) and
    never changes; ``int8_rows[i]`` is the most float32 rows segment i multiplies with int8
    activations (``quant_gemm_q8_into``; 0: never) of ``terms`` int8 terms a row, both fixed at
    construction; the raw tensors are never modified (a tied head shares the embedding's).
    Inference only."""

    def __init__(
        self,
        segments: Sequence[tuple[torch.Tensor, int]],
        in_features: int,
        bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        if not segments:
            raise ValueError("a QuantLinear needs at least one segment")
        segments = merge_segments(segments)
        self.in_features = in_features
        self.types = [int(t) for _, t in segments]
        self.offsets: list[int] = []
        n = 0
        for i, (raw, ggml_type) in enumerate(segments):
            per_block, size = block_shape(ggml_type)
            if raw.dtype != torch.uint8 or raw.dim() != 2 or not raw.is_contiguous():
                raise ValueError(f"segment {i}: raw rows must be contiguous uint8 [n, row_bytes]")
            if in_features % per_block or raw.shape[1] != in_features // per_block * size:
                raise ValueError(
                    f"segment {i}: {type_name(ggml_type)} rows of {raw.shape[1]} bytes do not "
                    f"hold {in_features} weights"
                )
            self.register_buffer(f"raw{i}", raw, persistent=False)
            self.offsets.append(n)
            n += raw.shape[0]
        self.out_features = n
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        native = native_types()
        self.kernels = ["native" if t in native else "dequantize" for t in self.types]
        mode = activation_mode()
        self.terms = _TERMS.get(mode, 1)
        served, max_rows = dot_types() if mode in _TERMS else (frozenset(), 0)
        self.int8_rows = [max_rows // self.terms if t in served else 0 for t in self.types]
        #: a one-segment native linear's whole call (``quant_linear``: the int8 path up to
        #: ``int8_rows[0]`` float32 rows, else the float one), taken first by :meth:`forward`
        #: without its general loop (~35 us of Python a call otherwise on the Zen 3 host,
        #: 150 calls a SmolLM2 decode step)
        self._direct: tuple[Any, torch.Tensor, int, int, int] | None = None
        if len(self.types) == 1 and self.kernels[0] == "native":
            module = _native()
            if module is not None and hasattr(module, "quant_linear"):
                self._direct = (
                    module.quant_linear,
                    segments[0][0],
                    self.types[0],
                    self.int8_rows[0],
                    self.terms,
                )
        #: the bias as a plain tensor (a Parameter is looked up through ``nn.Module``'s
        #: ``__getattr__`` on every call)
        self._bias = None if self.bias is None else self.bias.detach()
        for t, kernel in zip(self.types, self.kernels, strict=True):
            if kernel == "dequantize":
                if not can_dequantize(t):
                    raise ValueError(f"{type_name(t)}: neither a native kernel nor gguf.quants")
                _warn_fallback(t, "linear")

    @property
    def raws(self) -> list[torch.Tensor]:
        """Each segment's raw rows, in order."""
        return [getattr(self, f"raw{i}") for i in range(len(self.types))]

    @property
    def nbytes(self) -> int:
        """Bytes of the quantized rows held."""
        return sum(r.numel() for r in self.raws)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        direct = self._direct
        if direct is not None and x.dim() == 2 and x.is_cpu:
            fn, raw, ggml_type, int8_rows, terms = direct
            y = fn(x, raw, ggml_type, int8_rows, terms)
            return y if self._bias is None else y.add_(self._bias)
        rows = x.reshape(-1, self.in_features)
        if not rows.is_contiguous():
            rows = rows.contiguous()
        out = torch.empty(rows.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        module = None
        m = rows.shape[0] if rows.dtype == torch.float32 else 0
        for raw, ggml_type, off, kernel, int8_rows in zip(
            self.raws, self.types, self.offsets, self.kernels, self.int8_rows, strict=True
        ):
            cols = out[:, off : off + raw.shape[0]]
            if 0 < m <= int8_rows:
                module = module or _native()
                module.quant_gemm_q8_into(rows, raw, ggml_type, cols, self.terms)
            elif kernel == "native":
                module = module or _native()
                module.quant_gemm_into(rows, raw, ggml_type, cols)
            else:
                cols.copy_(F.linear(rows, dequantize_rows(raw, ggml_type, x.dtype)))
        if self.bias is not None:
            out.add_(self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def stack_entry(self) -> tuple[str, torch.Tensor, int, int, int] | None:
        """This linear as :mod:`radixkv.model.decoder_stack` passes it to the native
        ``decoder_layers_f32``: ``(native module name, raw rows, ggml type, int8 rows, terms)``
        where its whole forward is one ``quant_linear`` call (one native segment, no bias), else
        None."""
        if self._direct is None or self._bias is not None:
            return None
        fn, raw, ggml_type, int8_rows, terms = self._direct
        return fn.__module__, raw, ggml_type, int8_rows, terms

    def extra_repr(self) -> str:
        kinds = ", ".join(
            f"{r.shape[0]} rows {type_name(t)} ({k})"
            for r, t, k in zip(self.raws, self.types, self.kernels, strict=True)
        )
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, {kinds}"
        )


class QuantEmbedding(nn.Module):
    """Token embedding over block-quantized rows: ``forward(ids)`` dequantizes only the rows
    asked for (native ``quant_dequantize_rows``, else ``gguf.quants.dequantize`` of those rows),
    in ``dtype``. ``weight`` is a meta tensor of the table's shape and ``dtype`` (what the
    model reads the activations' dtype from); the raw rows are ``raw``, never modified."""

    def __init__(self, raw: torch.Tensor, ggml_type: int, embedding_dim: int, dtype: torch.dtype):
        super().__init__()
        self.ggml_type = int(ggml_type)
        self.num_embeddings, self.embedding_dim = raw.shape[0], embedding_dim
        self.register_buffer("raw", raw, persistent=False)
        self.weight = nn.Parameter(
            torch.empty(raw.shape[0], embedding_dim, dtype=dtype, device="meta"),
            requires_grad=False,
        )
        module = _native()
        self.kernel = (
            "native"
            if module is not None
            and hasattr(module, "quant_dequantize_rows")
            and self.ggml_type in native_types()
            else "dequantize"
        )
        if self.kernel == "dequantize" and not can_dequantize(self.ggml_type):
            raise ValueError(
                f"{type_name(self.ggml_type)}: neither a native kernel nor gguf.quants"
            )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(torch.int64)
        dtype = self.weight.dtype
        if self.kernel == "native":
            rows = _native().quant_dequantize_rows(self.raw, self.ggml_type, flat, dtype)
        else:
            rows = dequantize_rows(self.raw[flat.cpu()], self.ggml_type, dtype)
        return rows.to(ids.device).view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, {type_name(self.ggml_type)} rows "
            f"({self.kernel})"
        )

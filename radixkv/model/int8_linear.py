"""Weight-only int8 linears (``--quantization int8``): per-output-channel symmetric scales.

Each output channel ``n`` of a weight ``W[N, K]`` is stored as ``q[n] = round(W[n] / s[n])``
clamped to ``[-127, 127]``, with ``s[n] = max_k |W[n, k]| / 127`` held in the activations'
dtype (float32 or bfloat16; a zero row gets ``s = 1`` and ``q = 0``). The quantized model *is*
the one with weights ``q * s`` (the dequantized weights, :func:`dequantize`): that is what
the tests judge against a float64 forward of, so the only error beyond quantization's own is the
product's arithmetic. Activations stay in their dtype (weight-only quantization).

A decode's few rows (up to ``int8_linear_max_rows()``, 8) run on radixkv's native kernel
``int8_linear_rows`` (radixkv/model/csrc/cpu_int8_linear.cpp): each weight row read once, its
codes widened to float32 in registers against every row of x, the sum scaled once, float32
throughout (bf16 x and scales widened exactly, the result rounded once to x's dtype). More rows
(prefill chunks, larger batches) dequantize the weight and call ``F.linear``. Where the native
build is missing, torch's own ``torch.ops.aten._weight_int8pack_mm(x, q, s)`` takes calls of up
to :data:`INT8PACK_MAX_ROWS` rows: on this torch (2.13) its bfloat16 path reads ``K`` in
blocks of 8 and returns garbage (or crashes) for other ``K``, so it is used where
``in_features % 8 == 0``; elsewhere, and where the op is missing too, :class:`Int8Linear`
dequantizes the weight on each call (``F.linear`` on ``q * s``: correct, slower, with a
one-time warning). Off the CPU the same fallback applies.

Measured (AMD EPYC Zen 3, AVX2, float32, 2 threads, 30 distinct 1728x576 weights streamed from
DRAM, min of 7, per weight; ``python -m bench.bench_int8 --only kernels``): at 1 / 2 / 4
/ 8 rows the native kernel took 0.079 / 0.096 / 0.146 / 0.214 ms, ATen's 0.837 / 1.884 / 4.739 /
9.567, ``F.linear`` on the float weight 0.464 / 0.881 / 0.872 / 1.013 and dequantize +
``F.linear`` 6.018 / 6.675 / 2.456 / 4.419 (docs/performance.md, fifth Zen 3 session). SmolLM2-135M's int8 decode step went from ~118 ms (ATen's kernel,
0.77 ms a call) to the figures in docs/performance.md.

The plain weight is not kept: a float32 projection shrinks to a quarter (bf16 to a half), plus
``N`` scales. The lm_head and the embedding are left in the model's dtype (the head's error
reaches every logit directly, and the tied embedding would need a dequantizing gather).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "INT8PACK_MAX_ROWS",
    "Int8Linear",
    "dequantize",
    "int8_kernel_available",
    "quantize_linears",
    "quantize_per_channel",
]

log = logging.getLogger(__name__)

#: the largest code: symmetric, so -128 is never used and ``-q`` is always a code
QMAX = 127
#: calls with more rows dequantize the weight and run ``F.linear`` (the module docstring's A/B)
INT8PACK_MAX_ROWS = 3

_warned: set[str] = set()


def _native() -> Any:
    from radixkv.model import native

    return native.load()


def _native_rows(module: Any) -> int:
    """The most rows ``module``'s int8 kernel (``int8_linear_rows``) takes; 0 without it."""
    if module is None or not hasattr(module, "int8_linear_max_rows"):
        return 0
    return int(module.int8_linear_max_rows())


def int8_kernel_available() -> bool:
    """Whether this torch has ATen's ``_weight_int8pack_mm`` (torch >= 2.3 CPU builds)."""
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, s)``: ``q`` int8 ``[N, K]`` and ``s`` ``[N]`` in ``weight``'s dtype, so that
    ``q * s`` (exactly, in float64) is the int8 model's weight. The codes are computed from the
    scale as stored (rounded to ``weight``'s dtype), so ``|W - q * s| <= s / 2`` elementwise
    (the clamp binds only by rounding at the row's maximum)."""
    w = weight.detach().to(torch.float32)
    scale = (w.abs().amax(dim=1) / QMAX).to(weight.dtype)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale.to(torch.float32)[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q * s`` in ``dtype`` (float64 holds it exactly: 8-bit codes times a 24-bit scale)."""
    return q.to(dtype) * scale.to(dtype)[:, None]


class Int8Linear(nn.Module):
    """``y = x (q * s)^T + b``: weight-only int8 with per-output-channel scales.

    Holds ``qweight`` (int8 ``[out, in]``), ``scales`` (``[out]``, the model's dtype) and
    ``bias``, never the float weight. ``kernel`` is ``"native"`` (radixkv's ``int8_linear_rows``
    for calls of up to ``native_rows`` rows), ``"aten"`` (``_weight_int8pack_mm`` for calls of up
    to :data:`INT8PACK_MAX_ROWS` rows, without the native build) or ``"dequantize"`` (the
    fallback of the module docstring, every call); larger calls dequantize the weight. Inference only: the buffers must
    not be modified in place.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        q, scale = quantize_per_channel(linear.weight)
        self.register_buffer("qweight", q)
        self.register_buffer("scales", scale)
        self.bias = linear.bias
        aten = int8_kernel_available() and self.in_features % 8 == 0
        module = _native() if q.device.type == "cpu" else None
        self.native_rows = _native_rows(module)
        #: the native kernel's binding, looked up once (a call's lookup cost ~1 us, 7 a layer)
        self._rows_fn = module.int8_linear_rows if self.native_rows else None
        if self.native_rows:
            self.kernel = "native"
        else:
            self.kernel = "aten" if aten and q.device.type == "cpu" else "dequantize"
        if self.kernel == "dequantize" and self.kernel not in _warned:
            _warned.add(self.kernel)
            log.warning(
                "int8 linear %dx%d on %s: ATen's _weight_int8pack_mm %s; dequantizing the "
                "weight on each call (correct, slower)",
                self.out_features,
                self.in_features,
                q.device,
                "is missing" if not int8_kernel_available() else "does not serve it",
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.scales.dtype
        if x.dtype != dtype:
            return self(x.to(dtype)).to(x.dtype)
        flat = x.dim() == 2  # the layers' [T, K] calls: no reshape on the decode's hot path
        rows = x if flat else x.reshape(-1, self.in_features)
        fn = self._rows_fn
        if fn is not None and 0 < rows.shape[0] <= self.native_rows:
            y = fn(rows, self.qweight, self.scales)  # float32
            if dtype != torch.float32:
                y = y.to(dtype)
            if self.bias is not None:
                y.add_(self.bias)
            return y if flat else y.view(*x.shape[:-1], self.out_features)
        if self.kernel == "dequantize" or rows.shape[0] > INT8PACK_MAX_ROWS:
            return F.linear(x, dequantize(self.qweight, self.scales, dtype), self.bias)
        y = torch.ops.aten._weight_int8pack_mm(rows, self.qweight, self.scales)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, int8 per-channel ({self.kernel})"
        )


def quantize_linears(model: nn.Module, names: tuple[str, ...]) -> int:
    """Replace the ``nn.Linear`` children of ``model`` named in ``names`` (the decoder
    layers' projections, which nothing else shares) by :class:`Int8Linear`, their float weights
    dropped with them; returns how many."""
    linears = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and name in names
    ]
    count = len(linears)
    while linears:  # popped: the float weight dies with its linear
        parent, name, child = linears.pop()
        setattr(parent, name, Int8Linear(child))
        del child
    return count

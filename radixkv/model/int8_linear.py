"""Weight-only int8 linears (``--quantization int8``): per-output-channel symmetric scales.

Each output channel ``n`` of a weight ``W[N, K]`` is stored as ``q[n] = round(W[n] / s[n])``
clamped to ``[-127, 127]``, with ``s[n] = max_k |W[n, k]| / 127`` held in the activations'
dtype (float32 or bfloat16; a zero row gets ``s = 1`` and ``q = 0``). The quantized model *is*
the one with weights ``q * s`` (the dequantized weights, :func:`dequantize`): that is what
the tests judge against a float64 forward of, so the only error beyond quantization's own is the
product's arithmetic. Activations stay in their dtype (weight-only quantization).

The product runs on torch's own CPU kernel ``torch.ops.aten._weight_int8pack_mm(x, q, s)``
(``x @ (q * s)^T``; ATen's int8-weight GEMV/GEMM, float32 and bfloat16 activations). On this
torch (2.13) its bfloat16 path reads ``K`` in blocks of 8 and returns garbage (or crashes) for
other ``K``, so the kernel is used where ``in_features % 8 == 0`` (every real model's linears);
elsewhere, and where the op is missing, :class:`Int8Linear` dequantizes the weight on each call
(``F.linear`` on ``q * s``: correct, slower, with a one-time warning). Off the CPU the same
fallback applies.

The ATen kernel is a GEMV per row: on the AVX2 host (Zen 3, float32, 2 threads, 30 distinct
1728x576 weights streamed) it took 0.48 ms at 1 row where ``F.linear`` on the float weight took
0.28, and 0.96 / 1.4 / 1.9 / 3.9 / 31 ms at 2 / 3 / 4 / 8 / 64 rows, where dequantizing the
weight and calling ``F.linear`` took 3.4-4.2 ms at 1-3 rows and 0.52 / 0.51 / 1.2 ms at 4 / 8 /
64 rows (level with ``F.linear``'s 0.51 / 0.43 / 1.0). So calls of more than
:data:`INT8PACK_MAX_ROWS` rows (prefill chunks, batched decodes) dequantize, and the int8 model
is about as fast as the float one there; at 1-3 rows it is slower than the float model on this
host (the memory saved is the gain), see docs/performance.md.

The plain weight is not kept: a float32 projection shrinks to a quarter (bf16 to a half), plus
``N`` scales. The lm_head and the embedding are left in the model's dtype (the head's error
reaches every logit directly, and the tied embedding would need a dequantizing gather).
"""

from __future__ import annotations

import logging

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
    ``bias``, never the float weight. ``kernel`` is ``"aten"`` (``_weight_int8pack_mm`` for calls
    of up to :data:`INT8PACK_MAX_ROWS` rows, the weight dequantized per call above) or
    ``"dequantize"`` (the fallback of the module docstring, every call). Inference only: the buffers must
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
        rows = x.reshape(-1, self.in_features)
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

"""CPU linears with prepacked weights: oneDNN's blocked-weight GEMM for many rows.

``F.linear`` on the CPU calls MKL's sgemm on the plain ``[N, K]`` weight every time. oneDNN can
instead keep the weight *prepacked* in its blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, done once at load) and run
``torch.ops.mkldnn._linear_pointwise`` on it (``bench/bench_linears.py`` times both, side by
side, against a plain matmul). For one row (a batch-1 decode) the packed path measured no better
than MKL's sgemv, so :class:`PackedLinear` keeps the plain weight too and picks by row count.

:func:`prepack_linears` swaps a model's ``nn.Linear`` modules for :class:`PackedLinear` (same
``weight``/``bias`` parameters, so tied weights stay tied and state dicts are unchanged).
``RADIXKV_PACKED_LINEAR=0`` turns it off.

The Llama model packs every linear in float32 on the CPU. On the AVX2 host, with the weights
streamed from memory as in a real forward (``bench/bench_linears.py``'s "streamed" lines: every
layer's own weights, not one cache-resident matrix), oneDNN's packed GEMM ran the model's linears
1.75x faster than MKL's ``F.linear`` at 8 rows, 1.48x at 64 and 1.24x at 1024 (0.98x at one row,
which keeps ``F.linear``); its different summation order keeps the logits within the float64
precision contract (``tests/oracle.py``: the fp32 ratios went from 1.6-2.2 to 2.0-2.5, the bound
being 8). The packed copy costs a second copy of the weights' memory (the plain ``weight`` stays,
for state dicts, ties and one-row calls).

bfloat16 is packed too on hosts with native bf16. On a Zen 4 host (AVX512-BF16) at 64 rows
(``python -m bench.bench_linears --rows 1,64,1024 --dtype bfloat16 --all``) oneDNN's packed GEMM
beat ``F.linear`` on every shape of the model (gate_up 373 vs 128 GFLOP/s, o_proj 190 vs 114,
qkv 303 vs 247, down 404 vs 353, lm_head 386 vs 277).

Where the native kernels are built, the weights are packed for radixkv's own GEMM instead
(``csrc/cpu_linear.cpp``: register tiles over weights packed in the vector operand layout, the
next column chunk prefetched while one computes), bf16 on AVX512-BF16 builds and float32 on the
AVX2 build (Zen 3 hosts; AVX-512 builds keep oneDNN for float32, level with it there). On the
model's linears with the weights streamed (Zen 4): bf16 406 GFLOP/s where oneDNN ran 341 at 64
rows (a batch-64 decode), 375 vs 275 at 32, 433 vs 391 at 128, level at 1,024-2,048; float32
with both held to AVX2, 208 vs 163 at 64 rows, 176 vs 107 at 16 (``python -m
bench.bench_linears``). ``RADIXKV_CPU_GEMM=onednn`` keeps oneDNN.

On hosts with AMX-BF16 (Intel Sapphire Rapids and later) oneDNN's bf16 GEMM runs on the AMX
tiles, and from a few rows on it leaves any vector-unit GEMM far behind: on a Xeon (family 6
model 207, 2 cores) oneDNN ran the model's linears at 900-1,170 GFLOP/s at 64 rows and up to
2,250 at 2,048, radixkv's GEMM 130-165 at every row count, which still leads at 1-4 rows (62 vs
29 GFLOP/s at one row).

radixkv's GEMM has an AMX form too (``bf16_gemm_amx``): the packed weight is already AMX's B
operand layout, so tiles load it as it is; four accumulator tiles per two row tiles by two
column blocks (for 33-64 rows, four row tiles by one block), the next weights prefetched into
L2. On the same Xeon, the model's linears with the weights streamed (one-off A/Bs in one
process, alternated; the host's speed moved up to 2x between runs, the ratios less): at 64 rows
(a batch-64 decode) 0.76-0.86x oneDNN's time (then 0.89-0.95x of that with four row tiles by
one block), at 8-32 rows 0.55-0.69x, at 512-1,024 0.67-0.89x, at 1,536-2,048 1.06-1.31x; at 1
row level with the vector GEMM, from 4 rows ahead of it. In W1's decode steps the linears took
0.78-0.79x oneDNN's time (docs/performance.md). So on AMX hosts a bf16 linear whose
``in_features`` is a multiple of 32 runs the tile GEMM from :data:`AMX_MIN_ROWS` rows through
:data:`AMX_MAX_ROWS`, and oneDNN's (its packed copy kept for that) above; other shapes switch to
oneDNN from :data:`ONEDNN_AMX_MIN_ROWS` rows. ``RADIXKV_CPU_GEMM=native`` keeps radixkv's GEMMs
at every row count (the tile GEMM above :data:`AMX_MAX_ROWS` too).
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixkv.model import native
from radixkv.model.host_cpu import has_amx_bf16, has_native_bf16
from radixkv.model.repack import pack_dropping_source, pack_in_place

__all__ = [
    "PackedEmbedding",
    "PackedLinear",
    "native_gemm_module",
    "packed_alone",
    "packed_linear_supported",
    "prepack_linears",
    "AMX_MAX_ROWS",
    "AMX_MIN_ROWS",
    "ONEDNN_AMX_MIN_ROWS",
    "MIN_PACKED_ROWS",
]

log = logging.getLogger(__name__)

#: Native builds serving :class:`PackedLinear`, by module name (a layer keeps the name, not the
#: module, so it can be deep-copied).
_GEMM_MODULES: dict[str, Any] = {}

#: Below this many rows the plain weight (MKL sgemv) is used: for one row (a batch-1 decode)
#: the packed path measured no better, and at times worse, on the AVX2 host.
MIN_PACKED_ROWS = 2

#: On AMX-BF16 hosts a bf16 linear whose weight radixkv's tile GEMM takes runs it from this many
#: rows (level with the vector GEMM at 2 rows, ahead from 4: the model's linears at 4 rows
#: 9.1 vs 10.8 ms, at 8 rows 9.3 vs 14.6, Xeon model 207) ...
AMX_MIN_ROWS = 4
#: ... through this many; above it oneDNN's AMX GEMM (1.06-1.31x faster at 1,536-2,048 rows).
AMX_MAX_ROWS = 1024
#: Other bf16 linears on AMX-BF16 hosts run oneDNN's (AMX) from this many rows: at 8 rows oneDNN
#: led the vector GEMM on every shape of SmolLM2 (114-236 vs 100-137 GFLOP/s), at 4 on all but
#: one (``python -m bench.bench_linears --dtype bfloat16 --rows 4,8,12 --all``, Xeon model 207).
ONEDNN_AMX_MIN_ROWS = 8


def cpu_gemm_choice() -> str:
    """``RADIXKV_CPU_GEMM``: ``auto`` (default: radixkv's GEMM where :func:`native_gemm_module`
    allows it, on AMX-BF16 hosts oneDNN's AMX GEMM beside it for bf16's largest row counts, see
    :class:`PackedLinear`), ``native`` (radixkv's at every row count) or ``onednn`` (oneDNN's
    only)."""
    choice = os.environ.get("RADIXKV_CPU_GEMM", "auto").strip().lower() or "auto"
    if choice not in ("auto", "native", "onednn"):
        raise ValueError(f"RADIXKV_CPU_GEMM must be auto, native or onednn, got {choice!r}")
    return choice


def packed_linear_supported(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether prepacked oneDNN linears serve this dtype/device: the CPU with oneDNN, float32,
    or bfloat16 where the CPU has native bf16 (AVX512-BF16 / AMX; elsewhere bf16 is emulated
    and the packed path was not measured)."""
    if os.environ.get("RADIXKV_PACKED_LINEAR", "1") == "0":
        return False
    if torch.device(device).type != "cpu":
        return False
    if dtype != torch.float32 and not (dtype == torch.bfloat16 and has_native_bf16()):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    return hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(
        torch.ops.mkldnn, "_linear_pointwise"
    )


#: The native GEMM of each dtype: (has it, pack, multiply) names in the native module.
_GEMM_FUNCS = {
    torch.bfloat16: ("has_bf16_gemm", "pack_bf16_weight", "bf16_gemm"),
    torch.float32: ("has_f32_gemm", "pack_f32_weight", "f32_gemm"),
}


def native_gemm_module(weight: torch.Tensor) -> Any | None:
    """The native build whose GEMM serves ``weight``, or ``None``: a 2-D CPU weight in bfloat16
    (an AVX512-BF16 build, ``out_features % 16 == 0``, ``in_features`` even) or float32 (the
    AVX2 build, ``out_features % 8 == 0``; AVX-512 builds have the kernel too, but there oneDNN's
    float32 GEMM ran level with it at 64 rows and ~4% ahead at 1,024), and ``RADIXKV_CPU_GEMM``
    not ``onednn``.

    On AMX-BF16 hosts a bf16 weight it serves is also packed for oneDNN, which
    :class:`PackedLinear` runs for the largest row counts (unless ``RADIXKV_CPU_GEMM=native``).
    """
    if cpu_gemm_choice() == "onednn":
        return None
    funcs = _GEMM_FUNCS.get(weight.dtype)
    if funcs is None or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    module = native.load()
    if module is None or not getattr(module, funcs[0])():
        return None
    if weight.dtype == torch.bfloat16:
        cols, step = module.bf16_gemm_block()
    else:
        cols, step = module.f32_gemm_cols(), 1
        if cols != 8:
            return None  # AVX-512 builds: oneDNN's float32 GEMM measured level or ahead there
    if weight.shape[0] % cols or weight.shape[1] % step:
        return None
    return module


def packed_alone(weight: torch.Tensor) -> bool:
    """Whether :class:`PackedLinear` holds ``weight`` in radixkv's native layout only (no oneDNN
    copy beside it), so that layout is all its GEMM reads and the plain weight may go."""
    if native_gemm_module(weight) is None:
        return False
    return not (weight.dtype == torch.bfloat16 and has_amx_bf16() and cpu_gemm_choice() == "auto")


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` also held packed for a faster GEMM (rows >= ``min_rows``).

    The packed copy is radixkv's own layout for its native GEMM where
    :func:`native_gemm_module` allows it (``kernel == "native"``, every row count), else oneDNN's
    (``kernel == "onednn"``; below ``min_rows`` rows ``F.linear`` on the plain weight). On an
    AMX-BF16 host a native bf16 linear runs radixkv's tile GEMM over the same packed copy from
    :data:`AMX_MIN_ROWS` rows where ``in_features % 32 == 0`` (``amx_tiles``), and holds oneDNN's
    copy too (``amx_packed``, ``None`` where it holds none), run from ``amx_min_rows`` rows:
    :data:`AMX_MAX_ROWS` + 1 beside the tile GEMM, :data:`ONEDNN_AMX_MIN_ROWS` without it.

    ``release_weight``: where the native layout is all the GEMM reads (:func:`packed_alone`),
    ``weight`` becomes a meta tensor of its shape and dtype. ``owned`` says the plain weight is
    the caller's alone and where it lives (:func:`radixkv.model.repack.memory_kind`): then a
    released one is packed without both layouts held whole (``"anon"``: in its own memory;
    ``"file"``: its file pages dropped as they are packed; :mod:`radixkv.model.repack`).

    Invariant: ``packed`` (and ``amx_packed``) are layouts of ``weight`` at construction; the
    weights are inference-only (``requires_grad=False``) and must not be modified in place
    afterwards. A deep copy packs the copied weights afresh (oneDNN's opaque packed tensor has
    no copy of its own).
    """

    def __init__(
        self,
        linear: nn.Linear,
        min_rows: int = MIN_PACKED_ROWS,
        release_weight: bool = False,
        owned: str | None = None,
    ) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.min_rows = min_rows
        self.amx_min_rows: int | None = None
        self.amx_packed: torch.Tensor | None = None
        self.amx_tiles = False
        module = native_gemm_module(self.weight)
        self._gemm: str | None = None if module is None else module.__name__
        if module is not None:
            _GEMM_MODULES[module.__name__] = module
            _, pack, self._gemm_fn = _GEMM_FUNCS[self.weight.dtype]
            self.kernel = "native"
            self.packed = _pack(module, pack, self.weight.detach(), owned, release_weight)
            if self.weight.dtype == torch.bfloat16 and has_amx_bf16():
                self.amx_tiles = self.in_features % 32 == 0 and module.bf16_gemm_amx_available()
                if cpu_gemm_choice() == "auto":
                    self.amx_min_rows = AMX_MAX_ROWS + 1 if self.amx_tiles else ONEDNN_AMX_MIN_ROWS
                    self.amx_packed = _onednn_pack(self.weight)
        else:
            self.kernel = "onednn"
            self.packed = _onednn_pack(self.weight)
        #: the GEMM a 2-D input of the weight's dtype goes to when no other kernel can take it
        #: (native, no AMX): :meth:`forward` calls it first, without its other checks (~17 us a
        #: call of Python otherwise, 2 ms of a batch-1 decode step's 26 on the Zen 3 host)
        self._direct: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        if self.kernel == "native" and self.amx_packed is None and not self.amx_tiles:
            self._direct = getattr(module, self._gemm_fn)
        self._dtype = self.weight.dtype
        #: the bias as a plain tensor (a Parameter is looked up through ``nn.Module``'s
        #: ``__getattr__`` on every call)
        self._bias = None if self.bias is None else self.bias.detach()
        if release_weight and self.kernel == "native" and self.amx_packed is None:
            # the native GEMM reads only the packed copy: the plain one would double the
            # layer's memory. A meta tensor keeps its shape and dtype for whoever asks.
            self.weight = nn.Parameter(
                torch.empty(self.weight.shape, dtype=self.weight.dtype, device="meta"),
                requires_grad=False,
            )

    def __deepcopy__(self, memo: dict) -> PackedLinear:
        if self.weight.is_meta:
            raise RuntimeError(
                "this PackedLinear released its plain weight (prepack_linears("
                "release_weights=True)); build the model again to copy it"
            )
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        linear.weight = copy.deepcopy(self.weight, memo)
        linear.bias = copy.deepcopy(self.bias, memo)
        return PackedLinear(linear, self.min_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        direct = self._direct
        if direct is not None and x.dtype == self._dtype and x.dim() == 2:
            y = direct(x, self.packed)
            return y if self._bias is None else y + self._bias
        rows = x.numel() // max(1, x.shape[-1])
        if self.amx_packed is not None and rows >= self.amx_min_rows and x.dtype == torch.bfloat16:
            return self._onednn(x, self.amx_packed)
        if self._gemm is not None and self.weight.is_meta and x.dtype != self.weight.dtype:
            return self(x.to(self.weight.dtype)).to(x.dtype)  # only the packed copy is held
        if self._gemm is not None and x.dtype == self.weight.dtype:
            module = _GEMM_MODULES[self._gemm]
            fn = "bf16_gemm_amx" if self.amx_tiles and rows >= AMX_MIN_ROWS else self._gemm_fn
            y = getattr(module, fn)(x.reshape(-1, self.in_features), self.packed)
            y = y.view(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias
        if rows < self.min_rows or self._gemm is not None:
            return F.linear(x, self.weight, self.bias)
        return self._onednn(x, self.packed)

    def stack_entry(self) -> tuple[str, torch.Tensor, int, int, int] | None:
        """This linear as :mod:`radixkv.model.decoder_stack` passes it to the native
        ``decoder_layers_f32``: ``(native module name, packed weight, -1, 0, 1)`` where its whole
        forward on float32 rows is ``f32_gemm`` over the packed copy (no bias), else None."""
        if self._direct is None or self._bias is not None or self._dtype != torch.float32:
            return None
        if self._gemm is None or self._gemm_fn != "f32_gemm":
            return None
        return self._gemm, self.packed, -1, 0, 1

    def _onednn(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    def extra_repr(self) -> str:
        rows = "all rows" if self.kernel == "native" else f"rows >= {self.min_rows}"
        if self.amx_tiles:
            rows = f"AMX tiles from {AMX_MIN_ROWS} rows"
        if self.amx_packed is not None:
            rows = f"rows < {self.amx_min_rows}" + (
                f" (AMX tiles from {AMX_MIN_ROWS})" if self.amx_tiles else ""
            )
            rows += f"; oneDNN (AMX) from {self.amx_min_rows} rows"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, packed={self.kernel} ({rows})"
        )


class PackedEmbedding(nn.Module):
    """The embedding of a tied head held once, in the head's native packed layout: a lookup
    gathers each row from :class:`PackedLinear`'s ``packed`` (``[N / cols, K / step, cols *
    step]``: row ``n`` is ``packed[n // cols, :, n % cols]``), exact, so the head's GEMM keeps
    its layout and no plain copy is held beside it. ``weight`` is the head's meta parameter
    (the tie stays visible: ``embed_tokens.weight is lm_head.weight``)."""

    def __init__(self, head: PackedLinear) -> None:
        super().__init__()
        if head.kernel != "native" or not head.weight.is_meta:
            raise ValueError("PackedEmbedding needs a PackedLinear holding only its native copy")
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self.weight = head.weight
        self.packed = p = head.packed
        step = 2 if p.dtype == torch.bfloat16 else 1
        self.cols = p.shape[2] // step
        # [N / cols, cols, K / step, step]: a row is the first two indices (a strided view)
        self.blocks = p.view(p.shape[0], p.shape[1], self.cols, step).transpose(1, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = self.blocks[flat // self.cols, flat % self.cols]
        return rows.view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows of the tied head's packed copy"


def _pack(
    module: Any, pack: str, weight: torch.Tensor, owned: str | None, release: bool
) -> torch.Tensor:
    """``weight`` in the native layout; where it is released and ``owned``, without holding
    both layouts whole (:mod:`radixkv.model.repack`)."""
    if not release or owned not in ("anon", "file") or not packed_alone(weight):
        return getattr(module, pack)(weight)
    cols = module.f32_gemm_cols() if weight.dtype == torch.float32 else module.bf16_gemm_block()[0]
    if owned == "anon":
        return pack_in_place(weight, cols)
    return pack_dropping_source(weight, cols)


def _onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` in oneDNN's blocked layout for ``torch.ops.mkldnn._linear_pointwise``."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def prepack_linears(
    model: nn.Module,
    names: tuple[str, ...] | None = None,
    release: tuple[str, ...] = (),
    owned: Callable[[torch.Tensor], str | None] | None = None,
) -> int:
    """Replace ``nn.Linear`` modules of ``model`` by :class:`PackedLinear`; returns how many.

    ``names``: only children with these attribute names (e.g. ``("lm_head",)``); ``None``: all.
    ``release``: children with these names drop their plain weight where only the packed copy is
    read (radixkv's native GEMM), unless another module shares it; ``RADIXKV_KEEP_PLAIN_WEIGHTS=1``
    keeps every one (a benchmark that compares against ``F.linear`` on them).
    ``owned(weight)``: where a weight nobody else holds lives (:class:`PackedLinear`'s
    ``owned``), None where someone else may hold it.
    Does nothing (returns 0) when :func:`packed_linear_supported` says no for the weights.
    """
    if os.environ.get("RADIXKV_KEEP_PLAIN_WEIGHTS") == "1":
        release = ()
    shared = {
        id(p)
        for m in model.modules()
        if type(m) is not nn.Linear
        for p in m.parameters(recurse=False)
    }
    linears = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and (names is None or name in names)
    ]
    if not linears:
        return 0
    w = linears[0][2].weight
    if not packed_linear_supported(w.dtype, w.device):
        return 0
    count = len(linears)
    while linears:  # popped: a replaced linear (and a released plain weight) dies as it goes
        parent, name, child = linears.pop()
        free = name in release and id(child.weight) not in shared
        kind = owned(child.weight) if free and owned is not None else None
        setattr(parent, name, PackedLinear(child, release_weight=free, owned=kind))
        del child
    return count

"""What the host CPU can do fast: its model name, the x86 ISA flags that matter to radixkv, and
whether it has native bfloat16 arithmetic.

The dtype default follows from :func:`has_native_bf16`: bf16 matmuls are ~4.5x faster than fp32
on a CPU with AVX512-BF16 or AMX-BF16, but on an AVX2-only CPU (e.g. AMD Zen 3) torch emulates
bf16 and it runs 2-3x *slower* than fp32. ``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` is not
the test for this: it is true on every AVX-512 CPU, native bf16 or not.

Flags are read from ``/proc/cpuinfo`` (Linux); elsewhere they are derived from torch's own CPU
capability probe (which cannot see bf16, so non-Linux x86 hosts default to fp32).
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

__all__ = [
    "RELEVANT_FLAGS",
    "cpu_flags",
    "cpu_model_name",
    "has_native_bf16",
    "relevant_flags",
    "best_isa",
]

#: The ISA extensions radixkv's kernels and torch's CPU paths care about, in report order.
RELEVANT_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_bf16",
    "amx_tile",
)

_CPUINFO = Path("/proc/cpuinfo")


def _cpuinfo_field(name: str) -> str | None:
    try:
        text = _CPUINFO.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == name:
            return value.strip()
    return None


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``/proc/cpuinfo`` spelling, e.g. ``avx2``, ``avx512_bf16``)."""
    flags = _cpuinfo_field("flags")
    if flags is not None:
        return frozenset(flags.split())
    import torch

    cap = torch.backends.cpu.get_cpu_capability()  # "AVX512", "AVX2", "DEFAULT", "ZVECTOR"...
    derived = set()
    if cap in ("AVX2", "AVX512"):
        derived |= {"avx2", "fma", "f16c"}
    if cap == "AVX512":
        derived |= {"avx512f", "avx512bw", "avx512vl"}
    return frozenset(derived)


@functools.cache
def cpu_model_name() -> str:
    """A human-readable CPU name (``/proc/cpuinfo`` ``model name``, else :mod:`platform`)."""
    return _cpuinfo_field("model name") or platform.processor() or platform.machine() or "unknown"


def has_native_bf16() -> bool:
    """Whether the CPU computes bfloat16 natively (AVX512-BF16 or AMX-BF16, or Arm BF16)."""
    flags = cpu_flags()
    return bool({"avx512_bf16", "amx_bf16", "bf16"} & flags)


@functools.cache
def has_amx_bf16() -> bool:
    """Whether bfloat16 matrix multiplies can run on AMX tiles here: the CPU has AMX-BF16 (Intel
    Sapphire Rapids and later) and the kernel lets this process use the tile state (torch asks
    for it, as oneDNN does; Linux grants it from 5.16)."""
    if not {"amx_bf16", "amx_tile"} <= cpu_flags():
        return False
    import torch

    init_amx = getattr(torch._C._cpu, "_init_amx", None)
    return bool(init_amx()) if init_amx is not None else True


def relevant_flags() -> list[str]:
    """The :data:`RELEVANT_FLAGS` this CPU has, in that order."""
    flags = cpu_flags()
    return [f for f in RELEVANT_FLAGS if f in flags]


def best_isa() -> str:
    """The widest x86 vector ISA level: ``avx512_bf16``, ``avx512``, ``avx2`` or ``portable``."""
    flags = cpu_flags()
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:
        return "avx512_bf16" if "avx512_bf16" in flags else "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return "portable"

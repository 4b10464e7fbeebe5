"""The dtype default follows the host CPU: bf16 only with native bf16, and a warning otherwise.

Expectations are computed from this host's own ``/proc/cpuinfo`` flags, so the tests hold on an
AVX2-only host (fp32 default, bf16 warns) and on an AVX512-BF16 host (bf16 default, no warning).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

from radixkv.model import host_cpu
from radixkv.model.runner import ModelRunner, default_dtype, warn_if_emulated_bf16

needs_cpuinfo = pytest.mark.skipif(
    not Path("/proc/cpuinfo").exists(), reason="reads the flags from /proc/cpuinfo (Linux)"
)


def _proc_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@needs_cpuinfo
def test_flags_and_native_bf16_match_proc_cpuinfo() -> None:
    flags = _proc_flags()
    assert host_cpu.cpu_flags() == frozenset(flags)
    native = "avx512_bf16" in flags or "amx_bf16" in flags
    assert host_cpu.has_native_bf16() is native
    assert host_cpu.relevant_flags() == [f for f in host_cpu.RELEVANT_FLAGS if f in flags]
    if native:
        assert host_cpu.best_isa() == "avx512_bf16" or "amx_bf16" in flags
    elif {"avx512f", "avx512bw", "avx512vl"} <= flags:
        assert host_cpu.best_isa() == "avx512"
    elif {"avx2", "fma"} <= flags:
        assert host_cpu.best_isa() == "avx2"
    assert host_cpu.cpu_model_name()


@needs_cpuinfo
def test_default_dtype_is_bf16_only_with_native_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RADIXKV_DTYPE", raising=False)
    flags = _proc_flags()
    expected = torch.bfloat16 if {"avx512_bf16", "amx_bf16"} & flags else torch.float32
    assert default_dtype("cpu") == expected
    monkeypatch.setenv("RADIXKV_DTYPE", "float32")
    assert default_dtype("cpu") == torch.float32


@needs_cpuinfo
def test_bf16_on_a_host_without_it_warns_once(
    tiny_llama: object, caplog: pytest.LogCaptureFixture
) -> None:
    flags = _proc_flags()
    emulated = not ({"avx512_bf16", "amx_bf16"} & flags)
    with caplog.at_level(logging.WARNING, logger="radixkv.model.runner"):
        runner = ModelRunner(tiny_llama, num_pages=4, page_size=16, dtype=torch.bfloat16)
    assert runner.dtype == torch.bfloat16
    lines = [r.getMessage() for r in caplog.records if "emulated" in r.getMessage()]
    assert len(lines) == (1 if emulated else 0)
    if emulated:
        assert "\n" not in lines[0] and "float32" in lines[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="radixkv.model.runner"):
        assert warn_if_emulated_bf16(torch.float32, "cpu") is False
        ModelRunner(tiny_llama, num_pages=4, page_size=16, dtype=torch.float32)
    assert not [r for r in caplog.records if "emulated" in r.getMessage()]


def test_flags_without_proc_cpuinfo_come_from_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_cpu, "_CPUINFO", Path("/nonexistent/cpuinfo"))
    host_cpu.cpu_flags.cache_clear()
    try:
        flags = host_cpu.cpu_flags()
        cap = torch.backends.cpu.get_cpu_capability()
        assert ("avx2" in flags) is (cap in ("AVX2", "AVX512"))
        assert not host_cpu.has_native_bf16()  # cannot be seen without cpuinfo: fp32 default
    finally:
        monkeypatch.undo()
        host_cpu.cpu_flags.cache_clear()
    if sys.platform.startswith("linux"):
        assert host_cpu.cpu_flags() == frozenset(_proc_flags())

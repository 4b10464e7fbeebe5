"""Fake hosts for the host-dependent code: a ``/proc/cpuinfo`` per CPU family, the machine name,
and what radixkv should make of each (so every branch is tested on whatever host runs the tests).

:func:`use_host` points :mod:`radixkv.model.host_cpu` at a fake cpuinfo file and
``platform.machine`` at the fake machine, clearing the cached flags; undo with
``monkeypatch.undo()`` and :func:`clear_caches` (the ``on_host`` fixtures do both).
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

import pytest

from radixkv.model import host_cpu

_BASE = (
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse "
    "sse2 ht syscall nx pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology cpuid pni "
    "pclmulqdq ssse3 cx16 sse4_1 sse4_2 x2apic movbe popcnt aes xsave hypervisor lahf_lm abm"
)
_AVX2 = _BASE + " avx f16c rdrand fma avx2 bmi1 bmi2 adx sha_ni xsaveopt"
_AVX512 = _AVX2 + " avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni"
_AVX512_BF16 = _AVX512 + " avx512ifma avx512vbmi avx512_vbmi2 avx512_bitalg avx512_bf16"
_AMX = _AVX512_BF16 + " avx512_fp16 amx_bf16 amx_tile amx_int8"


@dataclass(frozen=True)
class FakeHost:
    """A host and what radixkv should conclude about it."""

    name: str
    machine: str  # platform.machine()
    cpuinfo: str  # the text of /proc/cpuinfo
    model: str  # host_cpu.cpu_model_name()
    flags: frozenset[str]  # host_cpu.cpu_flags()
    isa: str  # native.host_isa() and host_cpu.best_isa()
    native_bf16: bool  # host_cpu.has_native_bf16(): the bf16 default and no emulation warning


def _x86(name: str, model: str, flags: str, isa: str, native_bf16: bool) -> FakeHost:
    cpu = (
        "processor\t: {n}\nvendor_id\t: GenuineIntel\ncpu family\t: 6\n"
        f"model name\t: {model}\nflags\t\t: {flags}\nbogomips\t: 4589.21\n\n"
    )
    text = cpu.format(n=0) + cpu.format(n=1)
    return FakeHost(name, "x86_64", text, model, frozenset(flags.split()), isa, native_bf16)


HOSTS = [
    _x86("amx", "Intel(R) Xeon(R) Platinum 8488C", _AMX, "avx512_bf16", True),
    _x86("avx512-bf16", "AMD EPYC 9R14 96-Core Processor", _AVX512_BF16, "avx512_bf16", True),
    _x86("avx512", "Intel(R) Xeon(R) Platinum 8175M CPU @ 2.50GHz", _AVX512, "avx512", False),
    _x86("avx2", "AMD EPYC 7R13 Processor", _AVX2, "avx2", False),
    _x86("no-avx", "Intel(R) Atom(TM) CPU C2750 @ 2.40GHz", _BASE, "portable", False),
    # aarch64 /proc/cpuinfo has "Features", not "flags", and no "model name"
    FakeHost(
        "aarch64",
        "aarch64",
        "processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 "
        "crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp sve svebf16 i8mm bf16\n"
        "CPU implementer\t: 0x41\nCPU architecture: 8\nCPU part\t: 0xd40\n\n",
        "aarch64",
        frozenset(),  # no x86 flags; torch reports no AVX capability there
        "portable",
        False,  # Arm BF16 is in "Features", which host_cpu does not read (see test_host_cpu)
    ),
]
HOST_IDS = [h.name for h in HOSTS]


def clear_caches() -> None:
    host_cpu.cpu_flags.cache_clear()
    host_cpu.cpu_model_name.cache_clear()


def use_host(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, host: FakeHost) -> None:
    path = tmp_path / f"cpuinfo-{host.name}"
    path.write_text(host.cpuinfo)
    monkeypatch.setattr(host_cpu, "_CPUINFO", path)
    monkeypatch.setattr(platform, "machine", lambda: host.machine)
    monkeypatch.setattr(platform, "processor", lambda: "")
    if host.machine != "x86_64":  # what torch's CPU probe says on such a host
        monkeypatch.setattr("torch.backends.cpu.get_cpu_capability", lambda: "DEFAULT")
    clear_caches()

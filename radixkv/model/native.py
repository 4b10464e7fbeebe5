"""radixkv's native CPU kernels (``radixkv/model/csrc``), compiled on first use for the host's ISA.

**ISA dispatch.** :func:`host_isa` reads what the CPU can run (``/proc/cpuinfo`` flags, see
:mod:`radixkv.model.host_cpu`) as one of :data:`ISAS`, widest first:

- ``avx512_bf16``: AVX-512 F/BW/VL + AVX512-BF16 (the bf16 kernel's ``vdpbf16ps`` path);
- ``avx512``: AVX-512 F/BW/VL (fp32 kernels with 512-bit vectors);
- ``avx2``: AVX2 + FMA + F16C (fp32 kernels with 256-bit vectors, bf16/fp16 converted in registers);
- ``portable``: whatever the compiler's baseline target is (SSE2 on x86-64).

The sources are compiled with explicit flags for that ISA (:data:`ISA_FLAGS`, never
``-march=native``) into ``<cache dir>/torch_extensions/radixkv_cpu_<isa>_<hash>``, the hash
covering the sources and the flags, so a build made on one host is never loaded on a host that
lacks its instructions, and an edited source rebuilds. ``RADIXKV_ISA=<isa>`` forces a lower level
(e.g. ``avx2`` on an AVX-512 host, to test that path); asking for one the host cannot run raises
``ValueError`` naming the missing instruction. :func:`kernel_isa` says what the loaded build uses.

If the build fails (no C++ compiler, unusual platform) :func:`load` returns ``None``, warns once,
and callers fall back to the pure-torch paths. ``RADIXKV_NATIVE=0`` disables the kernels.
The kernels run with the GIL released, as torch's own ops do, so a server's HTTP and tokenizing
threads run while the engine thread is inside one; ``RADIXKV_NATIVE_GIL=hold`` keeps it held.
``radixkv prepare-model`` (run by ``setup.sh``) builds them ahead of the first request.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

__all__ = [
    "ISAS",
    "ISA_FLAGS",
    "ISA_REQUIRES",
    "load",
    "available",
    "build_error",
    "host_isa",
    "kernel_isa",
    "missing_instructions",
    "runnable_isas",
]

log = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [
    _CSRC / "bindings.cpp",
    _CSRC / "cpu_attention.cpp",
    _CSRC / "cpu_attention_amx.cpp",
    _CSRC / "cpu_attention_f32.cpp",
    _CSRC / "cpu_decoder.cpp",
    _CSRC / "cpu_fused.cpp",
    _CSRC / "cpu_int8_linear.cpp",
    _CSRC / "cpu_kv_store.cpp",
    _CSRC / "cpu_linear.cpp",
    _CSRC / "cpu_quant_dot.cpp",
    _CSRC / "cpu_quant_linear.cpp",
    _CSRC / "cpu_sample.cpp",
]
# every header of csrc, so a new one (or an edit to one) is in the build's hash and rebuilds it
_HEADERS = sorted(_CSRC.glob("*.h"))
_MODULE_PREFIX = "radixkv_cpu"

#: ISA levels, widest first.
ISAS = ("avx512_bf16", "avx512", "avx2", "portable")
#: ``/proc/cpuinfo`` flags each level needs.
ISA_REQUIRES: dict[str, tuple[str, ...]] = {
    "avx512_bf16": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"),
    "avx512": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"),
    "avx2": ("avx2", "fma", "f16c"),
    "portable": (),
}
#: Compiler flags of each level (added to ``-O3 -fopenmp``).
ISA_FLAGS: dict[str, tuple[str, ...]] = {
    "avx512_bf16": (
        "-mavx2",
        "-mfma",
        "-mf16c",
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512dq",
        "-mavx512bf16",
    ),
    "avx512": ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"),
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "portable": (),
}

_lock = threading.Lock()
_state: dict[str, Any] = {}
# load(None)'s module and level by (RADIXKV_ISA, machine, CPU flags): the default level is
# re-read at each call (a test may switch it), but its answer need not be re-derived
_defaults: dict[tuple[str, str, frozenset[str]], tuple[Any, str]] = {}


def missing_instructions(isa: str) -> list[str]:
    """The ``/proc/cpuinfo`` flags ``isa`` needs that this host lacks (empty: it can run it)."""
    if isa not in ISA_REQUIRES:
        raise ValueError(f"unknown ISA {isa!r}: use one of {', '.join(ISAS)}")
    import platform

    from radixkv.model import host_cpu

    if isa != "portable" and platform.machine().lower() not in ("x86_64", "amd64"):
        return [f"x86-64 (this is {platform.machine()})"]
    flags = host_cpu.cpu_flags()
    return [f for f in ISA_REQUIRES[isa] if f not in flags]


def host_isa() -> str:
    """The widest level of :data:`ISAS` this CPU runs (ignores ``RADIXKV_ISA``)."""
    for isa in ISAS:
        if not missing_instructions(isa):
            return isa
    return "portable"


def _target_isa() -> str:
    """The level to build: the host's, or ``RADIXKV_ISA`` if set (it must run here)."""
    forced = os.environ.get("RADIXKV_ISA", "").strip().lower()
    if not forced:
        return host_isa()
    missing = missing_instructions(forced)
    if missing:
        raise ValueError(
            f"RADIXKV_ISA={forced} needs {', '.join(missing)}, which this CPU lacks "
            f"(host ISA: {host_isa()})"
        )
    return forced


def _build_name(isa: str) -> str:
    """``radixkv_cpu_<isa>_<hash of sources + headers + flags>``."""
    h = hashlib.sha256()
    for path in _SOURCES + _HEADERS:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    h.update(" ".join(ISA_FLAGS[isa]).encode())
    return f"{_MODULE_PREFIX}_{isa}_{h.hexdigest()[:12]}"


def _build(isa: str) -> Any:
    from torch.utils import cpp_extension

    from radixkv.model.loader import cache_dir

    name = _build_name(isa)
    build_dir = cache_dir() / "torch_extensions" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    fresh = not any(build_dir.glob("*.so"))
    if fresh:  # a minute or two of silence otherwise, on first use or after a source change
        log.info("building radixkv's native CPU kernels for %s (first use; about a minute)", isa)
    start = time.perf_counter()
    # torch's own build lock is a file that stays when its holder is killed (Ctrl-C during the
    # first build, a crashed replica), and every later start then waits on it forever. Every
    # radixkv builder holds this flock first, which the kernel drops with its holder: holding
    # it, any torch lock file in the directory is such a leftover and is removed.
    with open(build_dir / ".radixkv-build.flock", "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            log.warning("removing a build lock left by a killed process: %s", stale)
            stale.unlink(missing_ok=True)
        module = cpp_extension.load(
            name=name,
            sources=[str(s) for s in _SOURCES],
            extra_cflags=["-O3", "-fopenmp", *ISA_FLAGS[isa], f"-DRADIXKV_ISA_NAME={isa}"],
            extra_include_paths=[str(_CSRC)],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
        )
    if fresh:
        log.info("native CPU kernels for %s built in %.0f s", isa, time.perf_counter() - start)
    return module


def load(isa: str | None = None) -> Any | None:
    """The compiled module (``paged_attention``, ``paged_attention_f32``, ``rms_norm``...) or
    ``None`` (disabled, or the build failed: see :func:`build_error`).

    ``isa=None`` loads the default level: ``RADIXKV_ISA`` if set, else :func:`host_isa` (read at
    each call, so a test may switch levels between runners). An explicit ``isa`` loads that
    level and raises ``ValueError`` if this host cannot run it. Each level is built and loaded
    once per process; modules of several levels can live side by side (their names differ).
    """
    if os.environ.get("RADIXKV_NATIVE", "1") == "0":
        _state["error"] = "disabled by RADIXKV_NATIVE=0"
        return None
    if isa is None:  # the per-layer calls: what decides the default level, looked up
        import platform

        from radixkv.model import host_cpu

        key = (os.environ.get("RADIXKV_ISA", ""), platform.machine(), host_cpu.cpu_flags())
        hit = _defaults.get(key)
        if hit is not None:
            _state["isa"] = hit[1]
            return hit[0]
        try:
            target = _target_isa()
        except ValueError as exc:  # a RADIXKV_ISA this host cannot run: warn, use pure torch
            _record_failure(None, exc)
            return None
    else:
        missing = missing_instructions(isa)
        if missing:
            raise ValueError(f"ISA {isa} needs {', '.join(missing)}, which this CPU lacks")
        target = isa
    modules: dict[str, Any] = _state.setdefault("modules", {})
    if target not in modules:
        with _lock:
            if target not in modules:
                try:
                    modules[target] = _build(target)
                except Exception as exc:  # a compiler error must not take the engine down
                    _record_failure(target, exc)
                    modules[target] = None
                else:  # AMX attention items (cpu_attention_amx.cpp) default on where available
                    if os.environ.get("RADIXKV_AMX_ATTENTION", "1") == "0":
                        modules[target].set_amx_attention(False)
    module = modules[target]
    if isa is None:
        _state["isa"] = target if module is not None else None
        if module is not None:
            _defaults[key] = (module, target)
    return module


def _record_failure(isa: str | None, exc: Exception) -> None:
    """Remember why a level is unavailable and warn once per reason."""
    error = f"{type(exc).__name__}: {exc}"
    if _state.get("error") != error:
        log.warning(
            "radixkv native CPU kernels unavailable%s (%s); using pure-torch attention",
            f" for {isa}" if isa else "",
            str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
        )
    _state["error"] = error


def available() -> bool:
    """Whether the native kernels built and loaded."""
    return load() is not None


def kernel_isa() -> str | None:
    """The ISA level of the default build (``None`` if the kernels are unavailable)."""
    return _state.get("isa") if load() is not None else None


def runnable_isas() -> list[str]:
    """Every level of :data:`ISAS` this host can run, widest first (``portable`` always)."""
    return [isa for isa in ISAS if not missing_instructions(isa)]


def build_error() -> str | None:
    """Why :func:`load` returned ``None`` (``None`` if it did not, or was not called)."""
    return _state.get("error")

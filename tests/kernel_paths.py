"""Every CPU attention path this host can run, as a pytest parameter.

The engine picks its attention path at run time (dtype, the host's ISA, environment overrides), so
a suite that only runs the default checks one path per host. These parameters run a test once per
path the host can execute: the float32-math native kernel at every ISA level the CPU runs
(``RADIXKV_ISA``), the torch cascade and the plain backend (``RADIXKV_FP32_ATTENTION``); for bf16
the native build at every level (the AVX512-BF16 kernel where the level has it) and pure torch
(``RADIXKV_NATIVE=0``). Levels the host lacks are not collected, so no test claims a path it
did not run; :func:`assert_runs_path` checks that a runner really took the path it is labelled
with.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from radixkv.model import native

__all__ = ["KernelPath", "assert_runs_path", "bf16_paths", "fp32_paths", "use_path"]


@dataclass(frozen=True)
class KernelPath:
    """One attention path: its label (the test id), environment and dtype."""

    label: str
    dtype: torch.dtype
    env: dict[str, str] = field(default_factory=dict)
    isa: str | None = None  # the native build's level, for native paths

    def __str__(self) -> str:
        return self.label


def fp32_paths() -> list[KernelPath]:
    native_paths = [
        KernelPath(f"native-{isa}", torch.float32, {"RADIXKV_ISA": isa}, isa)
        for isa in native.runnable_isas()
    ]
    return native_paths + [
        KernelPath("cascade", torch.float32, {"RADIXKV_FP32_ATTENTION": "cascade"}),
        KernelPath("plain", torch.float32, {"RADIXKV_FP32_ATTENTION": "plain"}),
    ]


def bf16_paths() -> list[KernelPath]:
    native_paths = [
        KernelPath(f"native-{isa}", torch.bfloat16, {"RADIXKV_ISA": isa}, isa)
        for isa in native.runnable_isas()
    ]
    return native_paths + [KernelPath("torch", torch.bfloat16, {"RADIXKV_NATIVE": "0"})]


def use_path(path: KernelPath, monkeypatch: pytest.MonkeyPatch) -> None:
    """Set ``path``'s environment (undone after the test); skip if its native build failed."""
    for name in ("RADIXKV_ISA", "RADIXKV_FP32_ATTENTION", "RADIXKV_NATIVE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in path.env.items():
        monkeypatch.setenv(name, value)
    if path.isa is not None and native.load(path.isa) is None:
        pytest.skip(f"the native {path.isa} build failed here: {native.build_error()}")


def expected_backend(path: KernelPath, head_dim: int) -> str:
    """The backend class a runner of ``path``'s dtype must build on this host."""
    if path.isa is None:
        if path.dtype == torch.float32 and path.env.get("RADIXKV_FP32_ATTENTION") == "plain":
            return "TorchAttentionBackend"
        return "CascadeTorchBackend"
    module = native.load(path.isa)
    if path.dtype == torch.bfloat16 and module.has_fast_path(head_dim):
        return "NativeAttentionBackend"
    return "NativeCascadeBackend"


def assert_runs_path(backend: object, path: KernelPath, head_dim: int) -> None:
    """``backend`` (a runner's) is the class and ISA level that ``path`` names."""
    want = expected_backend(path, head_dim)
    assert type(backend).__name__ == want, f"{path}: built {type(backend).__name__}, not {want}"
    if path.isa is not None:
        assert backend.isa == path.isa, f"{path}: the backend runs the {backend.isa} build"

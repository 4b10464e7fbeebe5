"""What radixkv runs on and with: host CPU and ISA, torch and its threads, dtype, attention
backend and native kernel path. ``radixkv info`` prints it; the server logs it at startup.

:func:`platform_info` answers for the defaults this host would pick (or for a built
:class:`~radixkv.model.runner.ModelRunner`, what it actually uses); :func:`format_platform_info`
renders it as one log line.
"""

from __future__ import annotations

from typing import Any

import torch

from radixkv.model import host_cpu

__all__ = ["platform_info", "format_platform_info"]


def _native_info() -> dict[str, Any]:
    """The native kernels' state: built or why not, and their ISA path when they report one."""
    from radixkv.model import native

    out: dict[str, Any] = {}
    module = native.load()
    if module is not None:
        out["native_kernels"] = "built"
        if hasattr(module, "amx_attention_available"):
            out["amx_attention"] = module.amx_attention_available()
    else:  # a compiler error is many lines: the first says which; the log has the rest
        why = (native.build_error() or "unknown").strip().splitlines() or ["unknown"]
        out["native_kernels"] = f"unavailable ({why[0][:160]})"
    for name in ("host_isa", "kernel_isa"):
        fn = getattr(native, name, None)
        if callable(fn):
            try:
                value = fn()
            except Exception as exc:  # a report must not fail because one probe did
                value = f"error: {type(exc).__name__}: {exc}"
            out[name] = (
                value if value is None or isinstance(value, (str, int, float)) else str(value)
            )
    return out


def platform_info(
    dtype: torch.dtype | None = None,
    head_dim: int = 64,
    device: str = "cpu",
    runner: Any = None,
) -> dict[str, Any]:
    """A JSON-able dict describing the host and the compute paths radixkv picks on it.

    Args:
        dtype: the dtype to report the backend for (``None``: this host's default).
        head_dim: the attention head dim the backend is chosen for (SmolLM2's is 64).
        device: ``"cpu"`` or ``"cuda"``.
        runner: a built ModelRunner: report its dtype and backend instead of the defaults.
    """
    from radixkv.model.runner import default_dtype

    default = default_dtype(device)
    if runner is not None:
        dtype = runner.dtype
        backend = runner.attention_backend
        impl = type(runner.backend).__name__
        inner = getattr(runner.backend, "inner", None)  # a wrapper (RotatedKVBackend) names it
        if inner is not None:
            impl += f"({type(inner).__name__})"
        head_dim = runner.config.head_dim
        device = str(runner.device)
    else:
        from radixkv.model.attention.factory import make_attention_backend

        dtype = dtype or default
        made = make_attention_backend(None, device, dtype, head_dim)
        backend, impl = made.name, type(made).__name__
    info: dict[str, Any] = {
        "cpu": host_cpu.cpu_model_name(),
        "isa": host_cpu.best_isa(),
        "isa_flags": host_cpu.relevant_flags(),
        "native_bf16": host_cpu.has_native_bf16(),
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "device": device,
        "default_dtype": str(default).removeprefix("torch."),
        "dtype": str(dtype).removeprefix("torch."),
        "attention_backend": backend,
        "attention_impl": impl,
        "head_dim": head_dim,
    }
    if torch.device(device).type == "cpu":
        info.update(_native_info())
    return info


def format_platform_info(info: dict[str, Any]) -> str:
    """One line: ``cpu=... isa=avx2 flags=avx2,fma,f16c dtype=float32 ... kernel_isa=...``."""
    parts = []
    for key, value in info.items():
        if isinstance(value, list):
            value = ",".join(str(v) for v in value) or "-"
        parts.append(f"{key}={value}")
    return " ".join(parts)

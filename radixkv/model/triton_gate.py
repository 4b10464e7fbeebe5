"""Triton only where a GPU is used.

radixkv's own Triton kernels load on first use (``radixkv.kernels``), but loading any model
through transformers imports ``torch._dynamo``, whose module body asks
``torch.utils._triton.has_triton_package()``, and that imports Triton when it is installed: on a
CPU host, a package of no use there, loaded for nothing (seconds of import, and with some
Triton builds hundreds of ``nanobind: leaked ...`` lines at exit).

:func:`skip_triton_without_gpu` tells torch Triton is absent before that happens, on a host that
will not use it. ``radixkv serve`` calls it first thing; the library never does (tests and users
may run the kernels under ``TRITON_INTERPRET=1`` on a CPU).
"""

from __future__ import annotations

import functools
import sys

__all__ = ["skip_triton_without_gpu"]


def skip_triton_without_gpu(
    device: str | None = None, attention_backend: str | None = None
) -> bool:
    """On a run that uses no GPU (``device`` cpu, or None with no CUDA device) and not the
    Triton attention backend, make torch's ``has_triton_package()`` answer False so importing
    ``torch._dynamo`` leaves Triton unloaded. Returns whether it did; does nothing (False) once
    Triton or ``torch._dynamo`` is already imported, or when torch lacks the hook."""
    if attention_backend == "triton" or "triton" in sys.modules or "torch._dynamo" in sys.modules:
        return False
    import torch

    if device is None:
        if torch.cuda.is_available():
            return False
    elif not str(device).startswith("cpu"):
        return False
    try:
        import torch.utils._triton as torch_triton
    except ImportError:  # pragma: no cover - a torch without the module: nothing to do
        return False
    if not callable(getattr(torch_triton, "has_triton_package", None)):
        return False  # pragma: no cover
    torch_triton.has_triton_package = functools.cache(lambda: False)
    return True

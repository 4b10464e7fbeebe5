"""radixkv's native CPU kernels (``radixkv/model/csrc``), compiled on first use.

The C++ sources are built with ``torch.utils.cpp_extension`` for the host CPU (``-march=native``)
into ``<cache dir>/torch_extensions`` (see :func:`radixkv.model.loader.cache_dir`); later imports
load the built module in milliseconds. ``radixkv prepare-model`` (run by ``setup.sh``) builds them
ahead of the first request.

If the build fails (no C++ compiler, unusual platform) :func:`load` returns ``None`` once, logs
why, and callers fall back to the pure-torch paths. ``RADIXKV_NATIVE=0`` disables the kernels.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

__all__ = ["load", "available", "build_error"]

log = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / "bindings.cpp", _CSRC / "cpu_attention.cpp", _CSRC / "cpu_fused.cpp"]
_MODULE_NAME = "radixkv_cpu_attention"
_lock = threading.Lock()
_state: dict[str, Any] = {}


def _build() -> Any:
    from torch.utils import cpp_extension

    from radixkv.model.loader import cache_dir

    build_dir = cache_dir() / "torch_extensions" / _MODULE_NAME
    build_dir.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(
        name=_MODULE_NAME,
        sources=[str(s) for s in _SOURCES],
        extra_cflags=["-O3", "-march=native", "-fopenmp"],
        extra_include_paths=[str(_CSRC)],
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
        verbose=False,
    )


def load() -> Any | None:
    """The compiled module (``paged_attention``, ``rms_norm``, ``silu_mul``...) or ``None``."""
    if "module" in _state:
        return _state["module"]
    with _lock:
        if "module" not in _state:
            module = None
            if os.environ.get("RADIXKV_NATIVE", "1") == "0":
                _state["error"] = "disabled by RADIXKV_NATIVE=0"
            else:
                try:
                    module = _build()
                except Exception as exc:  # a compiler error must not take the engine down
                    _state["error"] = f"{type(exc).__name__}: {exc}"
                    log.warning(
                        "radixkv native CPU kernels unavailable (%s); using pure-torch attention",
                        str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
                    )
            _state["module"] = module
    return _state["module"]


def available() -> bool:
    """Whether the native kernels built and loaded."""
    return load() is not None


def build_error() -> str | None:
    """Why :func:`load` returned ``None`` (``None`` if it did not, or was not called)."""
    return _state.get("error")

"""Shared fixtures. Triton runs under its interpreter when there is no GPU."""

from __future__ import annotations

import os

# Must be set before triton is imported anywhere.
if not os.environ.get("CUDA_VISIBLE_DEVICES_FORCE_GPU"):
    try:
        import torch

        _has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover
        _has_cuda = False
    if not _has_cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")

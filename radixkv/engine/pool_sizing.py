"""How many tokens the device KV pool holds: from ``kv_cache_tokens``, a budget in GiB, a share of
memory, or by default a share of the memory available, as vLLM and SGLang size theirs.

The pool's memory is mapped, not written: its pages are touched on first use (or in idle time
with ``--prefault-kv``), so a large default pool costs address space, not resident memory, until
the cache fills.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from radixkv.config import EngineConfig

logger = logging.getLogger(__name__)
__all__ = [
    "DEFAULT_KV_MEMORY_FRACTION",
    "PoolSize",
    "available_memory_bytes",
    "fraction_budget_gb",
    "kv_bytes_per_token",
    "size_kv_pool",
]

#: the share of memory a pool takes when no size is given: on CPU of ``MemAvailable`` once the
#: model is loaded (the host keeps room for other processes, tiers and activations); on CUDA of the
#: GPU's memory, weights included (vLLM's ``gpu_memory_utilization`` default)
DEFAULT_KV_MEMORY_FRACTION = {"cpu": 0.2, "cuda": 0.9}
#: a default-sized pool is capped at what every running sequence at full context needs, and at
#: least this many tokens (a tiny model would otherwise get millions of pages of metadata)
DEFAULT_MIN_CAP_TOKENS = 65536


@dataclass(frozen=True)
class PoolSize:
    """The pool's size in tokens (whole pages) and, for the start-up line, how it was chosen."""

    tokens: int
    how: str


def available_memory_bytes() -> int:
    """Host memory available to new allocations (Linux ``MemAvailable``; else free pages)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def fraction_budget_gb(
    fraction: float, device: torch.device, loaded: Any, dtype: torch.dtype
) -> tuple[float, str]:
    """The KV pool's budget in GiB for a memory ``fraction`` and where it came from: on CUDA,
    ``fraction`` of the GPU's total memory less the weights (in ``dtype``) and what this process
    already holds there (vLLM's ``gpu_memory_utilization``); on CPU, ``fraction`` of the memory
    available now, the model being loaded. Raises ``ValueError`` when nothing is left."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        weights = loaded.num_parameters() * dtype.itemsize
        held = torch.cuda.memory_reserved(device)
        budget = fraction * total - weights - held
        where = (
            f"{fraction} of the GPU's {total / 2**30:.1f} GiB less "
            f"{weights / 2**30:.2f} GiB of weights"
        )
    else:
        available = available_memory_bytes()
        budget = fraction * available
        where = f"{fraction} of the {available / 2**30:.1f} GiB of memory available"
    if budget <= 0:
        raise ValueError(f"kv_cache_memory_fraction leaves no room for the KV pool ({where})")
    return budget / 2**30, where


def kv_bytes_per_token(hf_config: Any, dtype: torch.dtype) -> int:
    """Bytes of K and V one token takes over all layers in ``dtype`` (a pool's element type:
    int8 / uint8 count each row's scale too, :mod:`radixkv.model.kv_quant`)."""
    from radixkv.model.kv_pool import KVPool

    heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    head_dim = (
        getattr(hf_config, "head_dim", None)
        or hf_config.hidden_size // hf_config.num_attention_heads
    )
    return KVPool.bytes_per_page_for(hf_config.num_hidden_layers, 1, heads, head_dim, dtype)


def size_kv_pool(
    cfg: EngineConfig,
    device: torch.device,
    loaded: Any,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    context: int,
) -> PoolSize:
    """The pool's tokens (a multiple of ``cfg.page_size``) for ``cfg``, pages stored as
    ``kv_dtype`` (the weights in ``dtype``): ``kv_cache_tokens`` as given; else
    ``kv_cache_memory_gb``; else ``kv_cache_memory_fraction``; else the default share of memory
    (:data:`DEFAULT_KV_MEMORY_FRACTION`), capped at ``max_running_requests`` sequences of
    ``context`` tokens (at least :data:`DEFAULT_MIN_CAP_TOKENS`). Raises ``ValueError`` when the
    budget holds no page."""
    P = cfg.page_size
    if cfg.kv_cache_tokens is not None:
        return PoolSize(cfg.kv_cache_tokens // P * P, "kv_cache_tokens")
    per_token = kv_bytes_per_token(loaded.config, kv_dtype)
    if cfg.kv_cache_memory_gb is not None:
        budget_gb, how, knob = cfg.kv_cache_memory_gb, "kv_cache_memory_gb", "kv_cache_memory_gb"
        cap = None
    else:
        given = cfg.kv_cache_memory_fraction
        fraction = given if given is not None else DEFAULT_KV_MEMORY_FRACTION[device.type]
        budget_gb, how = fraction_budget_gb(fraction, device, loaded, dtype)
        knob = "kv_cache_memory_fraction"
        if given is None:
            how = f"default: {how}"
        cap = (
            None
            if given is not None
            else max(DEFAULT_MIN_CAP_TOKENS, cfg.max_running_requests * context)
        )
    tokens = int(budget_gb * (1 << 30)) // (per_token * P) * P
    if cap is not None and tokens > cap:
        tokens = cap // P * P
        how += f", capped at {cfg.max_running_requests} sequences of {context} tokens"
    if tokens < P:
        raise ValueError(f"the KV budget ({knob}: {budget_gb:.3g} GiB) holds no page")
    return PoolSize(tokens, f"{budget_gb:.2f} GiB budget ({how})")

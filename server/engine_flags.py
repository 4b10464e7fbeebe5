"""The engine knobs of ``radixkv serve``, one table: flags (radixkv's name first, then the vLLM
and SGLang spellings users type), help and choices; each flag's type and default come from
:class:`~radixkv.config.EngineConfig`'s field, so they are never copied by hand.

A flag left out keeps the engine's default (the parsed value is None). ``--dtype`` also takes
vLLM's ``auto`` (the engine's choice by device), ``half`` and ``float``; prefix caching is on
unless ``--disable-prefix-cache`` / ``--disable-radix-cache`` (SGLang) /
``--no-enable-prefix-caching`` (vLLM).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, NamedTuple

from radixkv.config import (
    ATTENTION_BACKENDS,
    DTYPES,
    EVICTION_POLICIES,
    KV_CACHE_DTYPES,
    KV_LAYOUTS,
    QUANTIZATIONS,
    SCHEDULE_POLICIES,
    WRITE_POLICIES,
    EngineConfig,
)

__all__ = ["DTYPE_ALIASES", "ENGINE_FLAGS", "EngineFlag", "add_engine_flags", "engine_kwargs"]

#: vLLM's ``--dtype`` spellings -> the engine's (None: chosen by device).
DTYPE_ALIASES: dict[str, str | None] = {"auto": None, "half": "float16", "float": "float32"}
#: SGLang's names of the attention backends radixkv has (torch: the native CPU kernels)
ATTENTION_ALIASES: dict[str, str] = {"torch_native": "torch", "intel_amx": "torch"}


class EngineFlag(NamedTuple):
    """One engine knob on the command line: its flags (the first is radixkv's), the
    :class:`~radixkv.config.EngineConfig` field, the help, and the values it takes."""

    flags: tuple[str, ...]
    knob: str
    help: str
    choices: tuple[str, ...] | None = None


ENGINE_FLAGS: list[EngineFlag] = [
    EngineFlag(
        ("--kv-cache-tokens", "--max-total-tokens"),
        "kv_cache_tokens",
        "device KV pool size in tokens (default: sized from memory, 0.2 of the memory "
        "available on CPU, 0.9 of the GPU's; the start-up log says how many tokens fit)",
    ),
    EngineFlag(
        ("--kv-cache-memory-gb",), "kv_cache_memory_gb", "size the KV pool from a budget in GiB"
    ),
    EngineFlag(
        ("--kv-cache-memory-fraction", "--gpu-memory-utilization", "--mem-fraction-static"),
        "kv_cache_memory_fraction",
        "size the KV pool from a share of memory, in (0, 1]: on CUDA the share of the GPU's "
        "memory the weights and the pool may take (vLLM's --gpu-memory-utilization, SGLang's "
        "--mem-fraction-static); on CPU the share of the memory available once the model is "
        "loaded (MemAvailable)",
    ),
    EngineFlag(("--page-size", "--block-size"), "page_size", "tokens per KV page"),
    EngineFlag(
        ("--schedule-policy",), "schedule_policy", "order of waiting requests", SCHEDULE_POLICIES
    ),
    EngineFlag(
        ("--eviction-policy",), "eviction_policy", "prefix cache eviction", EVICTION_POLICIES
    ),
    EngineFlag(
        ("--chunked-prefill-tokens", "--max-num-batched-tokens", "--chunked-prefill-size"),
        "chunked_prefill_tokens",
        "tokens one step computes: decodes plus prefill chunks",
    ),
    EngineFlag(
        ("--mixed-prefill-tokens",),
        "mixed_prefill_tokens",
        "prefill tokens a step may carry beside decodes, at most",
    ),
    EngineFlag(
        ("--mixed-prefill-min-tokens",),
        "mixed_prefill_min_tokens",
        "prefill tokens a step may carry beside decodes, at least (when prefills wait)",
    ),
    EngineFlag(
        ("--max-running-requests", "--max-num-seqs"), "max_running_requests", "batch size cap"
    ),
    EngineFlag(
        ("--max-model-len", "--context-length"),
        "max_model_len",
        "context length cap (default: the model's)",
    ),
    EngineFlag(
        ("--attention-backend",),
        "attention_backend",
        "attention kernels (default: triton on CUDA, torch on CPU)",
        (*ATTENTION_BACKENDS, *ATTENTION_ALIASES),
    ),
    EngineFlag(
        ("--dtype",),
        "dtype",
        "weights and KV dtype; auto (the default) picks by device, half = float16, float = float32",
        (*DTYPE_ALIASES, *DTYPES),
    ),
    EngineFlag(("--device",), "device", "cpu | cuda[:N] (default: cuda when available)"),
    EngineFlag(("--seed", "--random-seed"), "seed", "engine RNG seed"),
    EngineFlag(
        ("--tokenizer", "--tokenizer-path"),
        "tokenizer",
        "tokenizer to use instead of the model's: a local directory, or a Hugging Face id in "
        "the local cache",
    ),
    EngineFlag(
        ("--chat-template",),
        "chat_template",
        "chat template replacing the model's: a file's path or the Jinja text itself",
    ),
    EngineFlag(("--host-cache-tokens",), "host_cache_tokens", "host (CPU RAM) tier size; 0 = off"),
    EngineFlag(("--host-write-policy",), "host_write_policy", "host tier writes", WRITE_POLICIES),
    EngineFlag(
        ("--disk-cache-dir",), "disk_cache_dir", "directory of the disk tier (off if unset)"
    ),
    EngineFlag(("--disk-cache-bytes",), "disk_cache_bytes", "disk tier size in bytes"),
    EngineFlag(
        ("--disk-write-policy",),
        "disk_write_policy",
        "write_back (to disk on eviction and at shutdown) or write_through (at once)",
        WRITE_POLICIES,
    ),
    EngineFlag(
        ("--remote-cache",),
        "remote_cache_url",
        "shared remote tier, redis://HOST:PORT[/DB], or redis+cluster://HOST:PORT for a Redis "
        "Cluster (off if unset; a password: $RADIXKV_REDIS_PASSWORD)",
    ),
    EngineFlag(
        ("--remote-write-policy",),
        "remote_write_policy",
        "when pages reach the remote tier: write_through (when cached: other replicas share a "
        "prompt at once) or write_back (when they leave the device: fewer writes)",
        WRITE_POLICIES,
    ),
    EngineFlag(
        ("--kv-mac-key-file",),
        "kv_mac_key_file",
        "secret (file, mode 0600) keying the MAC of disk and Redis KV pages; replicas sharing "
        "a Redis share it (default: $RADIXKV_KV_MAC_KEY, else DISK_DIR/kv_mac.key)",
    ),
    EngineFlag(
        ("--kv-layout",),
        "kv_layout",
        "paged (page table) or virtual (contiguous per-request K/V mapped over shared pages; "
        "Linux CPU)",
        KV_LAYOUTS,
    ),
    EngineFlag(
        ("--kv-cache-dtype",),
        "kv_cache_dtype",
        "auto (the model's dtype), int8 or fp8_e4m3: KV pages as 8-bit codes with a bf16 scale "
        "per token and KV head (1.94x the tokens of bf16 at head dim 64), in every tier",
        KV_CACHE_DTYPES,
    ),
    EngineFlag(
        ("--quantization", "-q"),
        "quantization",
        "int8: the decoder layers' linears weight-only int8, one scale per output channel "
        "(lm_head and embedding unquantized); gguf: a .gguf model's quantized blocks (Q8_0, "
        "Q4_0, Q4_1, Q4_K, Q6_K) kept as the file has them and multiplied without dequantizing "
        "the matrices (llama, mistral and qwen2 GGUFs); unset: weights in --dtype (a GGUF "
        "dequantized). vLLM's other methods (fp8, awq, gptq, ...) are refused; "
        "--kv-cache-dtype quantizes the KV cache",
        QUANTIZATIONS,
    ),
]


def _knob_type(knob: str) -> Any:
    """The scalar type of an ``EngineConfig`` field (``int | None`` -> ``int``)."""
    hint = typing.get_type_hints(EngineConfig)[knob]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(t for t in typing.get_args(hint) if t is not type(None))
    return hint


_METAVARS: dict[Any, str] = {int: "N", float: "X"}


def _defaults() -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(EngineConfig)}


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """Add every flag of :data:`ENGINE_FLAGS` and the prefix-cache switches to ``parser``."""
    defaults = _defaults()
    group = parser.add_argument_group("engine (vLLM / SGLang spellings accepted)")
    for entry in ENGINE_FLAGS:
        default, kind = defaults[entry.knob], _knob_type(entry.knob)
        text = entry.help
        if default is not None and "default" not in text:
            text += f" (default {default})"
        metavar = None if entry.choices else _METAVARS.get(kind, entry.knob.upper())
        group.add_argument(
            *entry.flags,
            dest=entry.knob,
            type=kind,
            default=None,
            choices=entry.choices,
            metavar=metavar,
            help=text,
        )
    group.add_argument(
        "--enable-prefix-caching",
        dest="enable_prefix_cache",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the radix prefix cache (on by default; vLLM's spelling)",
    )
    group.add_argument(
        "--disable-prefix-cache",
        "--disable-radix-cache",
        dest="enable_prefix_cache",
        action="store_false",
        default=None,
        help="turn the radix prefix cache off (--disable-radix-cache: SGLang's spelling)",
    )


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The Engine knobs set on the command line (unset flags keep the engine's defaults)."""
    kwargs: dict[str, Any] = {}
    for entry in ENGINE_FLAGS:
        value = getattr(args, entry.knob, None)
        if entry.knob == "dtype" and value in DTYPE_ALIASES:
            value = DTYPE_ALIASES[value]
        if entry.knob == "attention_backend" and value is not None:
            value = ATTENTION_ALIASES.get(value, value)
        if value is not None:
            kwargs[entry.knob] = value
    if getattr(args, "enable_prefix_cache", None) is not None:
        kwargs["enable_prefix_cache"] = args.enable_prefix_cache
    return kwargs

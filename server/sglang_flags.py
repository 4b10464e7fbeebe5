"""``python -m sglang.launch_server`` flags that ``radixkv serve`` takes so that an SGLang launch
command runs unchanged (issue 58), beyond the ones radixkv or vLLM's table (:mod:`.vllm_flags`)
already has under the same name (``--host``, ``--port``, ``--api-key``, ``--served-model-name``,
``--dtype``, ``--context-length``, ``--mem-fraction-static``, ``--chunked-prefill-size``,
``--max-running-requests``, ``--page-size``, ``--schedule-policy``, ``--kv-cache-dtype``,
``--disable-radix-cache``, ``--chat-template``, ``--log-level``, ``--trust-remote-code``,
``--tool-call-parser``, ``--reasoning-parser``, ``--download-dir``, ``--load-format``,
``--quantization``, ``--revision``, ``--device``) and the aliases radixkv's own flags carry
(``--model-path``, ``--tokenizer-path``, ``--random-seed``, ``--max-total-tokens``,
``--max-queued-requests``). Each is done, a no-op or refused, said at start, as
:mod:`.peer_flags` describes.
"""

from __future__ import annotations

import argparse
from typing import Any

from .peer_flags import (
    PeerFlag,
    add_peer_flags,
    apply_peer_flags,
    noop,
    one_only,
    only,
    refuse,
    set_arg,
)

__all__ = ["SGLANG_FLAGS", "add_sglang_flags", "apply_sglang_flags"]

_PARALLEL = "run several replicas with `radixkv cluster --replicas N` instead"
_TIERS = (
    "radixkv's hierarchical cache is its host tier (--host-cache-tokens N), a disk tier "
    "(--disk-cache-dir) and a shared Redis tier (--remote-cache URL)"
)


def _hierarchical(value: Any, args: argparse.Namespace) -> str:
    if getattr(args, "host_cache_tokens", None):
        return f"radixkv's host tier is on ({args.host_cache_tokens} tokens, --host-cache-tokens)"
    raise ValueError(f"{_TIERS}: give --host-cache-tokens N to turn the host tier on")


SGLANG_FLAGS: list[PeerFlag] = [
    # parallelism and devices
    PeerFlag(("--tp-size", "--tp"), True, one_only("device", _PARALLEL)),
    PeerFlag(("--pp-size",), True, one_only("device", _PARALLEL)),
    PeerFlag(("--dp-size", "--dp"), True, one_only("replica", _PARALLEL)),
    PeerFlag(("--ep-size",), True, one_only("device", "radixkv serves no mixture-of-experts yet")),
    PeerFlag(("--nnodes",), True, one_only("node", _PARALLEL)),
    PeerFlag(("--base-gpu-id", "--gpu-id-step"), True, noop("--device picks the device")),
    PeerFlag(("--enable-p2p-check",), False, noop("one device")),
    # the scheduler and the KV cache
    PeerFlag(
        ("--max-prefill-tokens",),
        True,
        noop("a step's prefill is bounded by --chunked-prefill-size, as SGLang's chunks"),
    ),
    PeerFlag(
        ("--schedule-conservativeness",),
        True,
        noop("radixkv admits by free KV pages and preempts by recompute"),
    ),
    PeerFlag(("--enable-mixed-chunk",), False, noop("decode steps always carry prefill chunks")),
    PeerFlag(
        ("--disable-overlap-schedule",),
        False,
        noop("radixkv does not overlap scheduling with the forward"),
    ),
    PeerFlag(("--enable-hierarchical-cache",), False, _hierarchical),
    PeerFlag(
        (
            "--hicache-ratio",
            "--hicache-size",
            "--hicache-write-policy",
            "--hicache-storage-backend",
        ),
        True,
        refuse(_TIERS),
    ),
    PeerFlag(("--cuda-graph-max-bs", "--cuda-graph-bs"), True, noop("no CUDA graphs")),
    PeerFlag(("--disable-cuda-graph",), False, noop("radixkv captures no CUDA graphs")),
    PeerFlag(("--enable-torch-compile",), False, noop("no torch.compile of the model")),
    PeerFlag(("--torch-compile-max-bs",), True, noop("no torch.compile of the model")),
    PeerFlag(
        ("--sampling-backend",), True, only(("pytorch", "flashinfer"), "radixkv's own sampler")
    ),
    PeerFlag(
        ("--grammar-backend",), True, only(("xgrammar",), "structured outputs are xgrammar's")
    ),
    PeerFlag(
        ("--enable-deterministic-inference",),
        False,
        refuse("radixkv does not promise results independent of the batch they run in"),
    ),
    # the HTTP front, logging and metrics
    PeerFlag(("--enable-metrics",), False, noop("/metrics is always served")),
    PeerFlag(
        ("--log-requests",),
        False,
        set_arg(
            "log_requests",
            True,
            "one log line per finished request (token counts and latencies, never its text)",
        ),
    ),
    PeerFlag(("--log-requests-level",), True, noop("the request line never holds the text")),
    PeerFlag(
        ("--decode-log-interval",),
        True,
        noop("the stats line comes every --log-stats-interval seconds"),
    ),
    PeerFlag(("--show-time-cost",), False, noop("/metrics has the latency histograms")),
    PeerFlag(("--stream-interval",), True, noop("each token is streamed as it is made")),
    PeerFlag(
        ("--enable-cache-report",),
        False,
        noop("usage always has prompt_tokens_details.cached_tokens"),
    ),
    PeerFlag(("--watchdog-timeout",), True, noop("radixkv runs no step watchdog")),
    PeerFlag(("--file-storage-path",), True, noop("radixkv stores no request files")),
    # the model
    PeerFlag(
        ("--skip-tokenizer-init",),
        False,
        refuse("radixkv detokenizes its outputs; prompts as input_ids work with the tokenizer"),
    ),
    PeerFlag(("--is-embedding",), False, refuse("radixkv serves generation, not embeddings")),
    PeerFlag(
        ("--json-model-override-args",),
        True,
        refuse("the model's config.json is served as it is; edit a copy of it instead"),
    ),
    PeerFlag(
        ("--allow-auto-truncate",),
        False,
        refuse("a prompt over the context length is a 400 naming the lengths"),
    ),
    PeerFlag(
        ("--lora-paths",),
        True,
        refuse("radixkv serves one model's weights, without LoRA adapters"),
    ),
    PeerFlag(
        ("--speculative-algorithm", "--speculative-draft-model-path"),
        True,
        refuse("radixkv has no speculative decoding"),
    ),
]


def add_sglang_flags(parser: argparse.ArgumentParser) -> None:
    """Register every flag of :data:`SGLANG_FLAGS` (each stores its value, None when absent)."""
    add_peer_flags(
        parser, SGLANG_FLAGS, "sglang", "SGLang flags (each says at start what it does here)"
    )


def apply_sglang_flags(args: argparse.Namespace) -> list[str]:
    """Judge the SGLang flags given in ``args`` (see :func:`~.peer_flags.apply_peer_flags`)."""
    return apply_peer_flags(args, SGLANG_FLAGS, "sglang")

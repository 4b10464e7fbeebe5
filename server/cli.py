"""``radixkv serve``: build an :class:`~radixkv.Engine` and serve it over HTTP with uvicorn.

``add_serve_parser(subparsers)`` registers the subcommand (``radixkv/cli.py`` wires it in) and
``run_serve(args)`` runs it. Engine knobs are flags named after them (``--page-size`` ->
``page_size``); a flag left out keeps the engine's default.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

logger = logging.getLogger(__name__)

#: (flag, engine knob, type, help) for every engine knob exposed on the command line.
ENGINE_FLAGS: list[tuple[str, str, Any, str]] = [
    ("--kv-cache-tokens", "kv_cache_tokens", int, "device KV pool size in tokens"),
    ("--kv-cache-memory-gb", "kv_cache_memory_gb", float, "size the KV pool from a budget"),
    ("--page-size", "page_size", int, "tokens per KV page"),
    ("--schedule-policy", "schedule_policy", str, "fcfs | lpm | dfs-weight"),
    ("--eviction-policy", "eviction_policy", str, "lru | lfu | fifo"),
    ("--chunked-prefill-tokens", "chunked_prefill_tokens", int, "prefill chunk size"),
    (
        "--mixed-prefill-tokens",
        "mixed_prefill_tokens",
        int,
        "prefill tokens a step may carry beside decodes (default 2048: the whole budget)",
    ),
    ("--max-running-requests", "max_running_requests", int, "batch size cap"),
    ("--max-model-len", "max_model_len", int, "context length cap (default: the model's)"),
    ("--attention-backend", "attention_backend", str, "torch | triton (default: by device)"),
    ("--dtype", "dtype", str, "float32 | bfloat16 | float16 (default: by device)"),
    ("--device", "device", str, "cpu | cuda (default: cuda when available)"),
    ("--seed", "seed", int, "engine RNG seed"),
    ("--host-cache-tokens", "host_cache_tokens", int, "host (CPU RAM) tier size; 0 = off"),
    ("--host-write-policy", "host_write_policy", str, "write_back | write_through"),
    ("--disk-cache-dir", "disk_cache_dir", str, "directory of the disk tier (off if unset)"),
    ("--disk-cache-bytes", "disk_cache_bytes", int, "disk tier size in bytes"),
    (
        "--disk-write-policy",
        "disk_write_policy",
        str,
        "write_back (to disk on eviction and at shutdown) | write_through (at once)",
    ),
    (
        "--remote-cache",
        "remote_cache_url",
        str,
        "shared remote tier, redis://HOST:PORT[/DB] (off if unset)",
    ),
    (
        "--kv-mac-key-file",
        "kv_mac_key_file",
        str,
        "secret (file, mode 0600) keying the MAC of disk and Redis KV pages; replicas sharing "
        "a Redis share it (default: $RADIXKV_KV_MAC_KEY, else DISK_DIR/kv_mac.key)",
    ),
    (
        "--kv-layout",
        "kv_layout",
        str,
        "paged (page table, default) | virtual (contiguous per-request K/V mapped over shared "
        "pages; Linux CPU)",
    ),
]


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``radixkv serve`` on ``subparsers`` (sets ``func=run_serve``)."""
    from radixkv.server.app import DEFAULT_MAX_WAITING
    from radixkv.server.guards import DEFAULT_MAX_BODY_BYTES
    from radixkv.server.key_flags import add_key_flags
    from radixkv.server.routes_admin import DEFAULT_MAX_PIN_TTL, PinPolicy

    p = subparsers.add_parser(
        "serve",
        help="serve a model over HTTP (OpenAI-compatible + SGLang /generate)",
        description="Start the HTTP server: /v1/completions, /v1/chat/completions, /v1/models, "
        "/generate, /health, /metrics, /cache/stats, /flush_cache, /cache/pin, /cache/tree, "
        "/dashboard (a live view of the cache).",
    )
    p.add_argument(
        "model_arg",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="model name or path, as in `vllm serve MODEL` (or --model; default smollm2)",
    )
    p.add_argument("--model", default=None, help="model name or path (default smollm2)")
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="names clients use (the first is listed first); default: MODEL as given. The "
        "model's own name is always accepted too",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    add_key_flags(p)
    p.add_argument(
        "--allowed-host",
        action="append",
        default=None,
        metavar="NAME",
        help="without API keys only loopback Host headers are served (DNS rebinding): add a "
        "name (repeat; '*' = any)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help=f"larger request bodies get 413 before parsing (default {DEFAULT_MAX_BODY_BYTES})",
    )
    p.add_argument(
        "--max-waiting-per-key",
        type=int,
        default=None,
        help="requests one API key may have waiting for their first token (429 past it)",
    )
    p.add_argument(
        "--max-pin-ttl",
        type=float,
        default=DEFAULT_MAX_PIN_TTL,
        help=f"longest pin in seconds; a pin without ttl gets it; 0 = pins may last until "
        f"unpinned (default {DEFAULT_MAX_PIN_TTL:g})",
    )
    p.add_argument(
        "--pin-budget-share",
        type=float,
        default=PinPolicy.share,
        help=f"share of the KV pool all pins may hold (default {PinPolicy.share})",
    )
    p.add_argument(
        "--namespace-pin-budget-share",
        type=float,
        default=PinPolicy.namespace_share,
        help="share of the KV pool the pins of one namespace (a tenant) may hold "
        f"(default {PinPolicy.namespace_share})",
    )
    p.add_argument(
        "--log-stats-interval",
        type=float,
        default=10.0,
        help="seconds between stats lines (throughput, queue, KV use, hit rate) while busy; "
        "0 = none (default 10)",
    )
    p.add_argument(
        "--prefault-kv",
        action="store_true",
        help="commit the KV pool's memory in a background thread while the server is idle, so a "
        "burst's first writes to the pool do not fault (radixkv.model.prefault); for a host that "
        "serves only this: it holds the whole pool's memory (default: committed as it is used)",
    )
    p.add_argument(
        "--dashboard-text",
        choices=["show", "hide"],
        default="show",
        help="/dashboard and /cache/tree: show decoded prompt snippets, or token counts only",
    )
    p.add_argument(
        "--max-waiting",
        type=int,
        default=DEFAULT_MAX_WAITING,
        help=f"requests waiting for their first token before 503s (default {DEFAULT_MAX_WAITING})",
    )
    p.add_argument(
        "--disable-prefix-cache", action="store_true", help="turn the radix prefix cache off"
    )
    for flag, knob, kind, help_text in ENGINE_FLAGS:
        p.add_argument(flag, dest=knob, type=kind, default=None, help=help_text)
    p.add_argument("--log-level", default="info", help="uvicorn/log level (default info)")
    p.set_defaults(func=run_serve)
    return p


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The Engine knobs set on the command line (unset flags keep the engine's defaults)."""
    kwargs: dict[str, Any] = {}
    for _flag, knob, _kind, _help in ENGINE_FLAGS:
        value = getattr(args, knob, None)
        if value is not None:
            kwargs[knob] = value
    if getattr(args, "disable_prefix_cache", False):
        kwargs["enable_prefix_cache"] = False
    return kwargs


def _bind_names(host: str) -> list[str]:
    """The bind address as a ``Host`` name clients may use (none for a wildcard bind)."""
    return [] if host in ("0.0.0.0", "::", "") else [host.strip("[]")]


def resolve_model(args: argparse.Namespace) -> tuple[str, list[str]]:
    """(the model to load, the names to serve) from ``MODEL`` / ``--model`` and
    ``--served-model-name``. Raises ``ValueError`` when MODEL and --model disagree."""
    positional = getattr(args, "model_arg", None)
    flag = getattr(args, "model", None)
    if positional is not None and flag is not None and positional != flag:
        raise ValueError(f"two models given: {positional!r} (MODEL) and {flag!r} (--model)")
    model = positional or flag or "smollm2"
    return model, list(getattr(args, "served_model_name", None) or [model])


def run_serve(args: argparse.Namespace) -> int:
    """Build the engine and app, then run uvicorn until interrupted. Returns the exit code."""
    import uvicorn

    from radixkv import Engine
    from radixkv.server.app import create_app

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from radixkv.server.key_flags import key_warnings, keys_from_args
    from radixkv.server.routes_admin import PinPolicy

    try:
        model, served_names = resolve_model(args)
        keys = keys_from_args(args)
        pins = PinPolicy(
            max_ttl=args.max_pin_ttl or None,
            share=args.pin_budget_share,
            namespace_share=args.namespace_pin_budget_share,
        )
    except (OSError, ValueError) as exc:
        print(f"radixkv serve: {exc}", file=sys.stderr)
        return 2
    for warning in key_warnings(keys, args.host):
        logger.warning("%s", warning)
    knobs = engine_kwargs(args)
    try:
        engine = Engine(model=model, **knobs)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"radixkv serve: cannot build the engine: {exc}", file=sys.stderr)
        return 2
    runner = getattr(engine, "runner", None)
    if runner is not None:
        from radixkv.model.platform_info import format_platform_info, platform_info

        logger.info("platform: %s", format_platform_info(platform_info(runner=runner)))
    try:
        app = create_app(
            engine,
            api_key=keys.api_keys or None,
            admin_key=keys.admin_key,
            salt_from_api_key=keys.salt_from_api_key,
            max_waiting=args.max_waiting,
            max_waiting_per_key=args.max_waiting_per_key,
            model_name=served_names,
            dashboard_text=args.dashboard_text,
            public_metrics=args.public_metrics,
            allowed_hosts=_bind_names(args.host) + (args.allowed_host or []),
            max_body_bytes=args.max_body_bytes,
            pins=pins,
            log_stats_interval=args.log_stats_interval or None,
            prefault_kv=args.prefault_kv,
        )
    except ValueError as exc:
        print(f"radixkv serve: {exc}", file=sys.stderr)
        engine.close()
        return 2
    logger.info(
        "serving %s on http://%s:%d (max_model_len=%s)",
        app.state.model_name,
        args.host,
        args.port,
        getattr(engine, "max_model_len", "?"),
    )
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower())
    finally:
        engine.close()  # idempotent: the lifespan end (SIGTERM, SIGINT) closed it already
    return 0

"""``radixkv serve``: build an :class:`~radixkv.Engine` and serve it over HTTP with uvicorn.

``add_serve_parser(subparsers)`` registers the subcommand (``radixkv/cli.py`` wires it in) and
``run_serve(args)`` runs it. Engine knobs are flags named after them (``--page-size`` ->
``page_size``), with the vLLM / SGLang spellings as aliases (:mod:`.engine_flags`); a flag left
out keeps the engine's default.
"""

from __future__ import annotations

import argparse
import logging
import sys

from radixkv.server.engine_flags import ENGINE_FLAGS, add_engine_flags, engine_kwargs
from radixkv.server.sglang_flags import add_sglang_flags, apply_sglang_flags
from radixkv.server.vllm_flags import add_vllm_flags, apply_vllm_flags

__all__ = ["ENGINE_FLAGS", "add_serve_parser", "engine_kwargs", "resolve_model", "run_serve"]

logger = logging.getLogger(__name__)


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
    p.add_argument(
        "--model", "--model-path", default=None, help="model name or path (default smollm2)"
    )
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
        "--max-queued-requests",
        type=int,
        default=DEFAULT_MAX_WAITING,
        help=f"requests waiting for their first token before 503s (default {DEFAULT_MAX_WAITING})",
    )
    p.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="chat requests may bring their own chat_template (Jinja, rendered in "
        "transformers' sandbox); refused by default, as vLLM",
    )
    add_engine_flags(p)
    p.add_argument("--log-level", default="info", help="uvicorn/log level (default info)")
    add_vllm_flags(p)
    add_sglang_flags(p)
    p.set_defaults(func=run_serve)
    return p


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
    from radixkv.model.triton_gate import skip_triton_without_gpu

    # before anything imports torch._dynamo (loading the model does): no Triton on a CPU run
    skip_triton_without_gpu(getattr(args, "device", None), getattr(args, "attention_backend", None))
    import uvicorn

    from radixkv import Engine
    from radixkv.server.app import AppOptions, create_app

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from radixkv.server.key_flags import key_warnings, keys_from_args
    from radixkv.server.routes_admin import PinPolicy

    try:
        # a refused vLLM or SGLang flag stops here, saying why
        peer_lines = [f"vLLM flag {line}" for line in apply_vllm_flags(args)]
        peer_lines += [f"SGLang flag {line}" for line in apply_sglang_flags(args)]
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
    for line in peer_lines:
        logger.info("%s", line)
    for warning in key_warnings(keys, args.host):
        logger.warning("%s", warning)
    knobs = engine_kwargs(args)
    try:
        engine = Engine(model=model, **knobs)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"radixkv serve: cannot build the engine: {exc}", file=sys.stderr)
        return 2
    from radixkv.model.platform_info import format_platform_info, platform_info

    logger.info("platform: %s", format_platform_info(platform_info(runner=engine.runner)))
    try:
        options = AppOptions(
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
            trust_request_chat_template=args.trust_request_chat_template,
            prefault_kv=args.prefault_kv,
            log_requests=getattr(args, "log_requests", False),
            reasoning_parser=getattr(args, "reasoning_parser", None),
            tool_call_parser=getattr(args, "tool_call_parser", None),
        )
        app = create_app(engine, options)
    except ValueError as exc:
        print(f"radixkv serve: {exc}", file=sys.stderr)
        engine.close()
        return 2
    logger.info(
        "serving %s on http://%s:%d (max_model_len=%s)",
        app.state.model_name,
        args.host,
        args.port,
        engine.max_model_len,
    )
    if getattr(args, "fastapi_docs", True) is False:  # vLLM's --disable-fastapi-docs
        docs = {"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"}
        app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", "") not in docs]
    try:
        uvicorn.run(
            app,
            host=args.host,
            port=args.port,
            log_level=(getattr(args, "uvicorn_log_level", None) or args.log_level).lower(),
            access_log=getattr(args, "access_log", True),
            root_path=getattr(args, "root_path", None) or "",
            ssl_keyfile=getattr(args, "ssl_keyfile", None),
            ssl_certfile=getattr(args, "ssl_certfile", None),
            ssl_ca_certs=getattr(args, "ssl_ca_certs", None),
        )
    finally:
        engine.close()  # idempotent: the lifespan end (SIGTERM, SIGINT) closed it already
    return 0

"""``radixkv router``: the cache-aware router in front of ``radixkv serve`` replicas.

``add_router_parser(subparsers)`` registers the subcommand (``radixkv/cli.py`` wires it in) and
``run_router(args)`` runs it with uvicorn until interrupted.

Give the router the replicas' keys (``--api-key`` / ``--api-key-file``, ``--salt-from-api-key``,
``--admin-key`` / ``--admin-key-file`` / ``RADIXKV_ADMIN_KEY``): its prefix trees hold the
prompts, so it checks keys itself, keeps tenants apart and keeps its stats for the admin (see
:mod:`radixkv.server.router`). Without keys it is open and says so in its log.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from radixkv.server.key_flags import add_key_flags
from radixkv.server.router_policy import POLICIES

__all__ = ["add_router_parser", "run_router"]

logger = logging.getLogger(__name__)


def add_router_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``radixkv router`` on ``subparsers`` (sets ``func=run_router``)."""
    p = subparsers.add_parser(
        "router",
        help="route requests across radixkv replicas by cached prefix",
        description="An OpenAI/SGLang-compatible front for several `radixkv serve` replicas: "
        "each request goes to the replica holding the longest prefix of its prompt unless that "
        "replica is overloaded (cache_aware), or in turn (round_robin). Dead replicas are "
        "skipped; a request that fails before its first byte is retried on another one.",
    )
    p.add_argument(
        "--replica",
        action="append",
        required=True,
        metavar="URL",
        help="a replica's base URL, e.g. http://127.0.0.1:8001 (repeat for each)",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--policy", choices=POLICIES, default="cache_aware")
    p.add_argument(
        "--cache-threshold",
        type=float,
        default=0.5,
        help="cache_aware: follow the longest match when it covers more than this share of the "
        "prompt, else pick the replica with the smallest tree (default 0.5)",
    )
    p.add_argument(
        "--balance-abs-threshold",
        type=int,
        default=32,
        help="cache_aware: in-flight max - min above this (and above the relative threshold) "
        "sends to the least loaded replica (default 32)",
    )
    p.add_argument(
        "--balance-rel-threshold",
        type=float,
        default=1.0001,
        help="cache_aware: ... and max > min * this (default 1.0001)",
    )
    p.add_argument(
        "--health-interval", type=float, default=2.0, help="seconds between health checks"
    )
    p.add_argument(
        "--tree-capacity",
        type=int,
        default=1 << 20,
        help="characters remembered per replica (LRU beyond; default 1048576)",
    )
    add_key_flags(p)
    p.add_argument("--log-level", default="info", help="uvicorn/log level (default info)")
    p.set_defaults(func=run_router)
    return p


def fix_mmap_threshold(threshold: int = 128 * 1024) -> bool:
    """Pin glibc's mmap threshold (``M_MMAP_THRESHOLD``) at ``threshold`` bytes; True if set.

    glibc raises the threshold each time a mmapped block is freed (imports do that, up to ~0.5
    MiB), after which asyncio's 256 KiB socket read buffers come from the brk heap, and
    interleaved with the long-lived prefix-tree lists they fragment it: the router's RSS grew
    ~0.3 MiB per 1000 requests with in-use memory flat. A fixed threshold keeps them mmapped.
    A no-op where the C library has no ``mallopt`` (not glibc)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(-3, threshold))  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def serve_router_app(app: Any, host: str, port: int, log_level: str) -> None:
    """Serve a router app with uvicorn until interrupted, the mmap threshold pinned first
    (:func:`fix_mmap_threshold`): ``radixkv router`` and ``radixkv cluster`` both run it."""
    import uvicorn

    fix_mmap_threshold()
    uvicorn.run(app, host=host, port=port, log_level=log_level.lower())


def run_router(args: argparse.Namespace) -> int:
    """Build the router app and serve it until interrupted. Returns the exit code."""
    from radixkv.server.key_flags import key_warnings, keys_from_args
    from radixkv.server.router import create_router_app

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    knobs = {}
    if args.policy == "cache_aware":
        knobs = {
            "cache_threshold": args.cache_threshold,
            "balance_abs_threshold": args.balance_abs_threshold,
            "balance_rel_threshold": args.balance_rel_threshold,
        }
    try:
        keys = keys_from_args(args)
    except ValueError as exc:  # the message names the file, never a key
        print(f"radixkv router: {exc}", file=sys.stderr)
        return 2
    for warning in key_warnings(keys, args.host):
        logging.getLogger("radixkv.server.router").warning("%s", warning)
    api_keys, admin_key = keys.api_keys, keys.admin_key
    try:
        app = create_router_app(
            args.replica,
            args.policy,
            health_interval=args.health_interval,
            tree_capacity=args.tree_capacity,
            api_keys=api_keys,
            admin_key=admin_key,
            salt_from_api_key=keys.salt_from_api_key,
            public_metrics=args.public_metrics,
            **knobs,
        )
    except ValueError as exc:
        print(f"radixkv router: {exc}", file=sys.stderr)
        return 2
    if not api_keys and admin_key is None:
        logger.warning(
            "no --api-key: the router is open (its stats show how far prompts matched); give it "
            "the replicas' keys unless every client is trusted"
        )
    else:
        logger.info(
            "keys: %d API key(s)%s%s",
            len(api_keys),
            ", one tenant each" if args.salt_from_api_key else "",
            ", an admin key" if admin_key is not None else "",
        )
    logger.info(
        "routing (%s) on http://%s:%d to %s", args.policy, args.host, args.port, args.replica
    )
    serve_router_app(app, args.host, args.port, args.log_level)
    return 0

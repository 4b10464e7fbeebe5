"""The key flags ``radixkv serve``, ``radixkv router`` and ``radixkv cluster`` share:
``--api-key`` (repeatable), ``--api-key-file``, ``--salt-from-api-key``, ``--admin-key``,
``--admin-key-file`` (or ``RADIXKV_ADMIN_KEY``) and ``--public-metrics``. Without
``--api-key`` or ``--api-key-file`` the API key may come from ``RADIXKV_API_KEY`` (like vLLM's
``VLLM_API_KEY``), so it stays off command lines.

:func:`add_key_flags` registers them; :func:`keys_from_args` reads them into the keyword
arguments of ``create_app`` / ``create_router_app`` (the ``api_keys``, ``admin_key`` and
``salt_from_api_key`` of a :class:`~radixkv.server.tenancy.KeyRing`). Give a router the same
key flags as its replicas.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from .guards import LOOPBACK_HOSTS
from .tenancy import ADMIN_KEY_ENV, load_admin_key, load_api_keys

__all__ = ["API_KEY_ENV", "KeyArgs", "add_key_flags", "key_warnings", "keys_from_args"]

API_KEY_ENV = "RADIXKV_API_KEY"
"""The environment variable holding the API key when no flag gives one."""


@dataclass(frozen=True)
class KeyArgs:
    """The keys read from the command line (and the admin key's file or environment)."""

    api_keys: list[str]
    admin_key: str | None
    salt_from_api_key: bool


def add_key_flags(p: argparse.ArgumentParser, *, public_metrics: bool = True) -> None:
    """Register the key flags on ``p`` (``public_metrics``: also ``--public-metrics``)."""
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require 'Authorization: Bearer KEY' (every route but /health); repeat for "
        f"several keys (or set ${API_KEY_ENV})",
    )
    p.add_argument(
        "--api-key-file", default=None, help="more API keys, one a line ('#' comments skipped)"
    )
    p.add_argument(
        "--salt-from-api-key",
        action="store_true",
        help="each API key is a tenant with a cache namespace of its own (a hash of the key): "
        "tenants never share cached prefixes (the prefix-cache timing side channel)",
    )
    p.add_argument(
        "--admin-key",
        default=None,
        help="the key of the admin routes (flush, pin/unpin, integrity, the tree, global stats, "
        f"metrics); else --admin-key-file, else ${ADMIN_KEY_ENV}. Without it several API keys "
        "or tenants leave those routes closed",
    )
    p.add_argument("--admin-key-file", default=None, help="a file holding the admin key")
    if public_metrics:
        p.add_argument(
            "--public-metrics",
            action="store_true",
            help="/metrics needs no key (server-wide counts only: no prompt text, no per-key "
            "or prefix-match figure)",
        )


def keys_from_args(args: argparse.Namespace) -> KeyArgs:
    """The keys of parsed key flags. Raises ``ValueError`` (the message names a file or the
    rule broken, never a key) for an unreadable file, a bad key, or tenants without keys."""
    given = args.api_key
    if given is None and args.api_key_file is None and os.environ.get(API_KEY_ENV):
        given = [os.environ[API_KEY_ENV]]
    try:
        api_keys = load_api_keys(given, args.api_key_file)
    except OSError as exc:
        raise ValueError(f"cannot read the API keys: {exc}") from exc
    if args.salt_from_api_key and not api_keys:
        raise ValueError("--salt-from-api-key needs --api-key or --api-key-file")
    try:
        admin_key = load_admin_key(args.admin_key, args.admin_key_file)
    except OSError as exc:
        raise ValueError(f"cannot read the admin key: {exc}") from exc
    return KeyArgs(api_keys, admin_key, bool(args.salt_from_api_key))


def key_warnings(keys: KeyArgs, host: str) -> list[str]:
    """What an operator should hear at start about the keys given and the bind address."""
    out = []
    loopback = host.strip("[]").lower() in LOOPBACK_HOSTS
    if not keys.api_keys and keys.admin_key is None and not loopback:
        out.append(
            f"bound to {host} without --api-key: anyone who reaches the port may generate, read "
            "the cache tree (prompt text) and flush it; only loopback Host names are served "
            "unless --allowed-host says otherwise"
        )
    if keys.admin_key is None and (len(keys.api_keys) > 1 or keys.salt_from_api_key):
        out.append(
            "several API keys (or tenants) and no --admin-key: the admin routes (flush, pin, "
            "integrity, the tree, global stats, metrics) are closed to every key"
        )
    if len(keys.api_keys) > 1 and not keys.salt_from_api_key:
        out.append(
            f"{len(keys.api_keys)} API keys share one prefix-cache namespace: each key's "
            "requests can hit (and time) the others' cached prompts; --salt-from-api-key gives "
            "every key a namespace of its own"
        )
    return out

"""Tenants from API keys: each key gets a cache salt of its own, so tenants never share a prefix.

A prefix cache shared across tenants is a timing side channel: a tenant can tell from a fast
first token (or from ``cached_tokens``) that someone else sent a prompt beginning the same way
(vLLM's CVE-2025-46570; its defence is the per-request ``cache_salt``). With
``create_app(..., salt_from_api_key=True)`` (``radixkv serve --salt-from-api-key``) the server
derives the salt from the caller's API key, so tenants are separated without clients sending
one:

* the tenant salt is ``"tenant:" + sha256("radixkv-tenant\\0" + key)[:32 hex]``, never the key;
* a client's own ``cache_salt`` / ``salt`` still partitions further *within* its tenant: the
  salt used is ``tenant_salt + "/" + client_salt`` (the tenant part has a fixed length, so no
  client salt can reach another tenant's namespace);
* the same derivation covers every path that reads or writes the cache: generation requests,
  ``/cache/pin``, and the host and disk tiers (whose disk keys hash the salt).

The auth dependency sets the tenant of the request in a context variable
(:data:`REQUEST_TENANT_SALT`); :func:`effective_salt` combines it with the client's salt.
"""

from __future__ import annotations

import hashlib
from contextvars import ContextVar

__all__ = ["REQUEST_TENANT_SALT", "effective_salt", "load_api_keys", "tenant_salt"]

REQUEST_TENANT_SALT: ContextVar[str | None] = ContextVar("radixkv_tenant_salt", default=None)
"""The tenant salt of the request being served (None: no tenancy)."""


def tenant_salt(api_key: str) -> str:
    """The cache salt of the tenant holding ``api_key`` (a hash: the key is never stored)."""
    digest = hashlib.sha256(b"radixkv-tenant\0" + api_key.encode("utf-8")).hexdigest()
    return f"tenant:{digest[:32]}"


def effective_salt(client_salt: str | None) -> str | None:
    """The salt a request uses: its tenant's (if any) combined with the client's own."""
    tenant = REQUEST_TENANT_SALT.get()
    if tenant is None:
        return client_salt
    return tenant if client_salt is None else f"{tenant}/{client_salt}"


def load_api_keys(keys: list[str] | None, key_file: str | None) -> list[str]:
    """API keys from repeated ``--api-key`` flags and a keys file (one key a line; blank lines
    and ``#`` comments skipped). Raises ``ValueError`` for an empty or whitespace key."""
    out: list[str] = []
    for key in keys or []:
        out.append(key)
    if key_file:
        with open(key_file, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if line and not line.startswith("#"):
                    out.append(line)
    for key in out:
        if not key or key != key.strip() or any(c.isspace() for c in key):
            raise ValueError("an API key must be non-empty and contain no whitespace")
    return list(dict.fromkeys(out))

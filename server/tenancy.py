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
import os
import secrets
from contextvars import ContextVar
from dataclasses import dataclass

from .protocol import APIError

__all__ = [
    "ADMIN_KEY_ENV",
    "REQUEST_CALLER",
    "REQUEST_TENANT_SALT",
    "Caller",
    "KeyRing",
    "effective_salt",
    "load_admin_key",
    "load_api_keys",
    "tenant_salt",
]

ADMIN_KEY_ENV = "RADIXKV_ADMIN_KEY"
"""The environment variable :func:`load_admin_key` reads when no flag gives the admin key."""

REQUEST_TENANT_SALT: ContextVar[str | None] = ContextVar("radixkv_tenant_salt", default=None)
"""The tenant salt of the request being served (None: no tenancy)."""

REQUEST_CALLER: ContextVar[Caller | None] = ContextVar("radixkv_caller", default=None)
"""Who sent the request being served (set by the auth dependency; None before it ran)."""


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


def _check_key(key: str) -> None:
    if not key or key != key.strip() or any(c.isspace() for c in key):
        raise ValueError("an API key must be non-empty and contain no whitespace")


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
        _check_key(key)
    return list(dict.fromkeys(out))


def load_admin_key(key: str | None, key_file: str | None, env: bool = True) -> str | None:
    """The admin key from ``--admin-key``, else ``--admin-key-file`` (its first non-comment
    line), else the environment variable :data:`ADMIN_KEY_ENV` (when ``env``); None when none
    is given. Raises ``ValueError`` for an empty or whitespace key, or both flags at once."""
    if key is not None and key_file is not None:
        raise ValueError("give the admin key once: --admin-key or --admin-key-file, not both")
    if key is None and key_file is not None:
        keys = load_api_keys(None, key_file)
        if len(keys) != 1:
            raise ValueError(f"the admin key file {key_file} must hold exactly one key")
        key = keys[0]
    if key is None and env:
        key = os.environ.get(ADMIN_KEY_ENV) or None
    if key is not None:
        _check_key(key)
    return key


@dataclass(frozen=True)
class Caller:
    """Who sent a request: ``admin`` (the admin key, or any key when the keys are one trust
    domain, see :class:`KeyRing`), the cache ``salt`` of its tenant (None without tenancy) and
    ``key_id``, a short hash naming the key in per-key limits and usage (never the key)."""

    admin: bool
    salt: str | None
    key_id: str


ANONYMOUS = Caller(admin=True, salt=None, key_id="-")
"""The caller of a server without keys: every route is open (loopback ``Host`` only)."""


class KeyRing:
    """The keys one server (or router) accepts, and what each may do.

    * No keys at all: every caller is :data:`ANONYMOUS` (admin, no tenant).
    * ``admin_key`` set: it alone opens the admin routes (flush, pin/unpin, integrity, the tree,
      global stats, metrics); API keys are tenants' keys.
    * API keys without an admin key: one key and no tenancy is one trust domain, and that key
      is admin; several keys, or ``tenants``, leave the admin routes closed (403 naming
      ``--admin-key``): a key holder must not flush or read the others' cache.
    * ``tenants`` (``--salt-from-api-key``): each API key gets the cache salt
      :func:`tenant_salt` of its own. The admin is no tenant: its requests use the salt they
      name as it is, so the admin can address a tenant's namespace (``salt`` =
      ``tenant_salt(key)``), e.g. to pin that tenant's system prompt.

    Keys are compared in constant time with every key, so the time does not say which matched.
    """

    def __init__(
        self, api_keys: list[str] | None = None, admin_key: str | None = None, tenants: bool = False
    ) -> None:
        self.api_keys = list(dict.fromkeys(api_keys or []))
        self.admin_key = admin_key
        self.tenants = tenants
        if tenants and not self.api_keys:
            raise ValueError(
                "salt_from_api_key needs api_key: tenants are told apart by their keys"
            )
        if admin_key is not None and admin_key in self.api_keys:
            raise ValueError("the admin key must differ from every API key")
        all_keys = self.api_keys + ([admin_key] if admin_key is not None else [])
        self._keys = [k.encode("utf-8", "surrogatepass") for k in all_keys]
        single_domain = admin_key is None and len(self.api_keys) == 1 and not tenants
        self._callers = [
            Caller(
                admin=(k == admin_key) or single_domain,
                salt=tenant_salt(k) if tenants and k != admin_key else None,
                key_id=hashlib.sha256(b"radixkv-key-id\0" + k.encode()).hexdigest()[:12],
            )
            for k in all_keys
        ]

    @property
    def open(self) -> bool:
        """No key is configured: every caller is :data:`ANONYMOUS`."""
        return not self._keys

    @property
    def admin_possible(self) -> bool:
        """Some key (or none needed) opens the admin routes."""
        return self.open or any(c.admin for c in self._callers)

    def identify_key(self, key: str | None) -> Caller | None:
        """The caller holding ``key`` (None: no such key). :data:`ANONYMOUS` without keys."""
        if self.open:
            return ANONYMOUS
        if key is None:
            return None
        given = key.encode("utf-8", "surrogatepass")
        found = None
        for k, caller in zip(self._keys, self._callers, strict=True):
            if secrets.compare_digest(given, k):
                found = caller
        return found

    def authorize(self, authorization: str | None, admin: bool = False) -> Caller:
        """The caller of an ``Authorization`` header value, when it may go on: else
        :class:`~radixkv.server.protocol.APIError` 401 (no or a wrong key) or, with ``admin``,
        403 (a key that does not open the admin routes). No key is ever echoed."""
        caller = self.identify(authorization)
        if caller is None:
            raise APIError(
                401,
                "Incorrect or missing API key: send the header 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )
        if admin and not caller.admin:
            why = (
                "this route needs the admin key"
                if self.admin_key is not None
                else "there is no admin key (several API keys, or tenants, must not flush or "
                "read each other's cache): restart with --admin-key to use this route"
            )
            raise APIError(403, why, type="permission_error", code="admin_key_required")
        return caller

    def identify(self, authorization: str | None) -> Caller | None:
        """The caller of an ``Authorization: Bearer KEY`` header value (None: missing/wrong)."""
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer":
            return self.identify_key(None) if self.open else None
        return self.identify_key(token.strip())

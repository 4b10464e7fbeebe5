"""URLs of the remote KV tier: which ones are valid, and how logs show them (redacted).

A password comes in the URL (``redis://:PASSWORD@HOST:PORT/DB``) or from
``$RADIXKV_REDIS_PASSWORD`` (the URL's own wins); every URL shown is redacted.
"""

from __future__ import annotations

__all__ = ["PASSWORD_ENV", "SCHEMES", "parse_remote_url", "redact_url"]

PASSWORD_ENV = "RADIXKV_REDIS_PASSWORD"
SCHEMES = ("redis://", "rediss://", "unix://")


def redact_url(url: object) -> str:
    """``url`` with its credentials replaced by ``***`` (``redis://***@host:6379/0``): what
    stats, logs and error messages show, so a Redis password never leaves the process."""
    text = str(url)
    scheme, sep, rest = text.partition("://")
    if not sep:
        return text
    netloc, slash, path = rest.partition("/")
    if "@" in netloc:
        netloc = "***@" + netloc.rpartition("@")[2]
    query = ""
    if "?" in path:  # unix:///sock?password=... and redis://h/0?password=...
        path, _, params = path.partition("?")
        query = "?" + "&".join(
            f"{k}=***" if k.lower() in ("password", "username", "user") else f"{k}={v}"
            for k, _, v in (part.partition("=") for part in params.split("&"))
        )
    return f"{scheme}://{netloc}{slash}{path}{query}"


def parse_remote_url(url: str) -> str:
    """Check a remote cache URL (``redis://HOST:PORT[/DB]``, ``rediss://`` or ``unix://``) and
    return it; raises ``ValueError`` saying what a valid one looks like."""
    if not isinstance(url, str) or not url.startswith(SCHEMES):
        raise ValueError(
            f"remote_cache_url={redact_url(url)!r} is invalid: expected redis://HOST:PORT[/DB] "
            "(or rediss://..., unix:///path.sock)"
        )
    return url

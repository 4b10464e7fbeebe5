"""Secrets never leave the process: Redis credentials in stats, logs and errors; API keys on the
command lines ``radixkv cluster`` logs."""

from __future__ import annotations

import logging

import pytest

from radixkv.cache.remote_store import RemoteStore, parse_remote_url, redact_url
from radixkv.server.redaction import redact_argv


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:s3cret@10.0.0.5:6379/0", "redis://***@10.0.0.5:6379/0"),
        ("rediss://admin:s3cret@cache.example:6380", "rediss://***@cache.example:6380"),
        ("redis://10.0.0.5:6379/2", "redis://10.0.0.5:6379/2"),
        ("unix:///run/redis.sock?password=s3cret&db=1", "unix:///run/redis.sock?password=***&db=1"),
        # a query with no path (the second security read: shown in clear before)
        ("redis://10.0.0.5:6379?password=s3cret", "redis://10.0.0.5:6379?password=***"),
        ("rediss://h:6380?username=u&password=s3cret", "rediss://h:6380?username=***&password=***"),
        ("redis://:a@b@h:6379?db=0", "redis://***@h:6379?db=0"),
    ],
)
def test_redact_url_drops_credentials_only(url: str, shown: str) -> None:
    assert redact_url(url) == shown


@pytest.mark.parametrize(
    "url", ["redis://:hunter2@127.0.0.1:1/0", "redis://127.0.0.1:1?password=hunter2"]
)
def test_remote_store_never_shows_its_password(url: str, caplog: pytest.LogCaptureFixture) -> None:
    """Stats, repr, the unreachable-server warning and a bad-URL error: no password in any,
    whether it is in the URL's userinfo or in a query with no path."""
    # port 1: nothing listens, the store goes down
    store = RemoteStore(url, b"\0" * 32, background=False, timeout=0.2)
    try:
        with caplog.at_level(logging.WARNING):
            assert store.get_prefix([b"k" * 32]) == []  # fails to connect: the store goes down
            stats = store.stats()
        assert any("unreachable" in m for m in caplog.messages), caplog.messages
        text = " ".join([repr(store), str(stats), *caplog.messages])
        assert "hunter2" not in text
        assert stats["url"] == redact_url(url) and "***" in stats["url"]
    finally:
        store.close()
    with pytest.raises(ValueError) as err:
        parse_remote_url("http://:hunter2@example/")
    assert "hunter2" not in str(err.value)


def test_redact_argv_hides_keys_and_url_credentials() -> None:
    cmd = [
        "radixkv", "serve", "--api-key", "sk-one", "--api-key=sk-two", "--admin-key", "adm",
        "--remote-cache", "redis://:pw@127.0.0.1:6379/0", "--port", "8001",
        "--remote-cache=redis://127.0.0.1:6379?password=qpw",
    ]  # fmt: skip
    shown = " ".join(redact_argv(cmd))
    for secret in ("sk-one", "sk-two", "adm ", "pw@", "qpw"):
        assert secret not in shown + " ", (secret, shown)
    assert "--api-key *** --api-key=*** --admin-key ***" in shown
    assert "redis://***@127.0.0.1:6379/0 --port 8001" in shown

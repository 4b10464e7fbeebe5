"""Tenant isolation: a prefix cached under one salt is never a hit under another, in any tier;
``salt_from_api_key`` gives every API key a namespace of its own (CVE-2025-46570's defence).

The real engine on the tiny random Llama (``bench/tiny_model.py``) with a device pool small
enough that prefixes go through the host and disk tiers between requests.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_engine import ServerThread

from bench.tiny_model import tiny_loaded_model
from radixkv.engine.sampling import SamplingParams
from radixkv.server.app import create_app
from radixkv.server.routes_admin import PinPolicy
from radixkv.server.tenancy import load_api_keys, tenant_salt

MODEL = "test-model"
SECRET = "system: you are the assistant of tenant A; never reveal the launch date of project X"
FILLERS = [f"unrelated filler prompt number {i} with enough text to need pages" for i in range(3)]


def engine_with_tiers(disk_dir: Path, host: bool = True) -> Any:
    from radixkv.engine.engine import Engine

    return Engine(
        tiny_loaded_model(),
        page_size=4,
        kv_cache_tokens=128,
        host_cache_tokens=64 if host else 0,
        disk_cache_dir=str(disk_dir),
        disk_cache_bytes=1 << 20,
        attention_backend="torch",
        dtype="float32",
    )


def greedy() -> SamplingParams:
    return SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def push_out(engine: Any) -> None:
    """Evict everything from the device pool (the fillers need it), then finish disk writes."""
    for prompt in FILLERS:
        engine.generate(prompt, greedy(), salt="filler")
    if engine.tiers is not None:
        engine.tiers.sync()


@pytest.mark.parametrize("host", [True, False], ids=["host+disk", "disk-only"])
def test_salted_prefix_never_hits_under_another_salt(tmp_path: Path, host: bool) -> None:
    engine = engine_with_tiers(tmp_path, host=host)
    first = engine.generate(SECRET, greedy(), salt="tenant-a")[0]
    assert first.cached_tokens == 0
    push_out(engine)
    for other in ("tenant-b", None, "tenant-a ", "tenant-"):
        out = engine.generate(SECRET, greedy(), salt=other)[0]
        assert out.cached_tokens == 0, (other, out.cached_tokens_by_tier)
        assert out.token_ids == first.token_ids  # same model, same answer: only the cache differs
        push_out(engine)
    # the owner still hits, through the lower tiers
    again = engine.generate(SECRET, greedy(), salt="tenant-a")[0]
    lower = again.cached_tokens_by_tier.get("host", 0) + again.cached_tokens_by_tier.get("disk", 0)
    assert again.cached_tokens > 0 and lower > 0, again.cached_tokens_by_tier
    engine.check_integrity()
    engine.tiers.close()
    # a restarted engine on the same disk directory: still per salt
    fresh = engine_with_tiers(tmp_path, host=host)
    other = fresh.generate(SECRET, greedy(), salt="tenant-c")[0]  # never sent it
    assert other.cached_tokens == 0, other.cached_tokens_by_tier
    owner = fresh.generate(SECRET, greedy(), salt="tenant-a")[0]
    assert owner.cached_tokens_by_tier.get("disk", 0) > 0, owner.cached_tokens_by_tier
    fresh.check_integrity()
    fresh.tiers.close()


def test_tenant_salt_is_a_hash_of_the_key() -> None:
    salt = tenant_salt("sk-secret-key-123")
    assert "sk-secret" not in salt and "123" not in salt
    assert salt == tenant_salt("sk-secret-key-123") != tenant_salt("sk-secret-key-124")
    assert len(salt) == len(tenant_salt("x"))  # fixed length: no client salt reaches another


def test_salt_from_api_key_over_http(tmp_path: Path) -> None:
    engine = engine_with_tiers(tmp_path)
    seen: list[str | None] = []
    add = engine.add_request

    def recording_add(
        rid: str, prompt: Any, params: Any = None, salt: Any = None, owner: Any = None
    ) -> None:
        seen.append(salt)
        add(rid, prompt, params, salt=salt, owner=owner)

    engine.add_request = recording_add  # records the salts the server hands the engine
    keys = ["key-alpha", "key-beta"]
    app = create_app(
        engine,
        api_key=keys,
        admin_key=ADMIN,
        salt_from_api_key=True,
        model_name=MODEL,
        pins=PinPolicy(share=1.0, namespace_share=1.0),  # a small pool: budgets tested apart
    )
    with ServerThread(app) as srv:

        def complete(key: str | None, **extra: Any) -> httpx.Response:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            body = {"model": MODEL, "prompt": SECRET, "max_tokens": 3, "temperature": 0}
            return httpx.post(
                f"{srv.base_url}/v1/completions",
                json={**body, **extra},
                headers=headers,
                timeout=60,
            )

        def cached(r: httpx.Response) -> int:
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert cached(complete("key-alpha")) == 0
        assert cached(complete("key-alpha")) > 0  # its own prefix
        assert cached(complete("key-beta")) == 0  # never the other tenant's
        # a client salt cannot reach another tenant's namespace, not even alpha's own salt
        assert cached(complete("key-beta", cache_salt=tenant_salt("key-alpha"))) == 0
        # within a tenant, a client salt partitions further
        assert cached(complete("key-alpha", cache_salt="project-1")) == 0
        assert cached(complete("key-alpha", cache_salt="project-1")) > 0
        # through the tiers too
        for filler in FILLERS:
            r = complete("key-beta", prompt=filler)
            assert r.status_code == 200
        engine_loop = srv.app.state.engine_loop
        engine_loop.call_sync(lambda e: e.tiers.sync())
        r = complete("key-beta")
        assert cached(r) > 0  # beta's own first request is cached now, alpha's never counted
        assert cached(complete("key-alpha")) > 0
        # /generate and /cache/pin use the tenant namespace as well
        g = httpx.post(
            f"{srv.base_url}/generate",
            json={"text": SECRET, "sampling_params": {"max_new_tokens": 2}},
            headers={"Authorization": "Bearer key-beta"},
            timeout=60,
        )
        assert g.status_code == 200 and g.json()["meta_info"]["cached_tokens"] > 0, g.text
        # pins are the admin's (a tenant's pin loop would lock the pool): the admin pins into
        # a tenant's namespace by naming its salt
        pin = {"text": "a prompt only alpha would pin, long enough for pages"}
        p = httpx.post(
            f"{srv.base_url}/cache/pin",
            json=pin,
            headers={"Authorization": "Bearer key-alpha"},
            timeout=60,
        )
        assert p.status_code == 403 and p.json()["error"]["code"] == "admin_key_required"
        p = httpx.post(
            f"{srv.base_url}/cache/pin",
            json={**pin, "salt": tenant_salt("key-alpha")},
            headers={"Authorization": f"Bearer {ADMIN}"},
            timeout=60,
        )
        assert p.status_code == 200 and p.json()["pinned_tokens"] > 0, p.text
        # wrong or missing key
        assert complete("key-gamma").status_code == 401
        assert complete(None).status_code == 401
        engine_loop.call_sync(lambda e: e.check_integrity())
    assert seen and all(s is not None and s.startswith("tenant:") for s in seen), seen
    assert not any("key-" in s for s in seen if s)
    want = {tenant_salt("key-alpha"), tenant_salt("key-beta")}
    assert {s.split("/")[0] for s in seen if s} == want
    engine.tiers.close()


ADMIN = "admin-key-0"


def test_salt_from_api_key_needs_keys(tmp_path: Path) -> None:
    from fake_engine import FakeEngine

    with pytest.raises(ValueError, match="needs api_key"):
        create_app(FakeEngine(), salt_from_api_key=True)
    # the CLI refuses before building an engine
    from radixkv.server.cli import run_serve

    args = argparse.Namespace(
        api_key=None,
        api_key_file=None,
        salt_from_api_key=True,
        log_level="warning",
        model="no-such-model",
    )
    assert run_serve(args) == 2


def test_api_keys_from_flags_and_file(tmp_path: Path) -> None:
    f = tmp_path / "keys.txt"
    f.write_text("# tenants\nkey-one\n\n  key-two  \nkey-one\n")
    assert load_api_keys(["key-zero"], str(f)) == ["key-zero", "key-one", "key-two"]
    with pytest.raises(ValueError):
        load_api_keys(["with space"], None)
    with pytest.raises(OSError):
        load_api_keys(None, str(tmp_path / "missing"))

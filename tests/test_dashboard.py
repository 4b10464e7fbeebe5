"""The cache dashboard, for real.

* ``tree_view``: its schema (version 1, field by field), the node budget and the folding of the
  rest (every token and node of the tree is accounted for exactly once), heaviest-first selection,
  ``min_tokens``, hidden text, salt labels (a keyed hash, never the salt), tier residency;
* the server on the real engine (tiny random Llama, byte tokenizer): ``/cache/tree`` after two
  chats that share a system prompt has the shared prefix as one node whose snippet is the system
  prompt; ``/cache/stats?history=true`` samples; 401s with ``--api-key``; ``dashboard_text="hide"``;
* a real headless Chromium (Debian's ``chromium``; ``setup.sh`` installs it) renders
  ``/dashboard`` against the live server and the ``simulate --html`` report: the DOM shows the
  shared-prefix node with its snippet and a non-zero hit rate; screenshots go to
  ``bench/results/``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_engine import ServerThread

from radixkv.cache.allocator import BlockAllocator
from radixkv.cache.disk_store import HEADER, DiskStore
from radixkv.cache.host_pool import HostPool
from radixkv.cache.radix_tree import RadixTree
from radixkv.cache.tiers import TieredCache
from radixkv.cache.tree_view import NODE_FIELDS, TOP_FIELDS, salt_label, tree_view

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
SYSTEM = "You are a meticulous librarian. Answer in one short sentence and cite the shelf number."
QUESTIONS = ["Where are the atlases?", "Which shelf holds poetry?"]
KEY = "dash-key-123"
PAGE = 4

# The stable schema, written out literally: changing it must change this test.
SCHEMA_TOP = {
    "version": int,
    "page_size": int,
    "tick": int,
    "total_nodes": int,
    "total_tokens": int,
    "device_tokens": int,
    "host_tokens": int,
    "shown_nodes": int,
    "max_nodes": int,
    "min_tokens": int,
    "text": str,
    "nodes": list,
}
SCHEMA_NODE = {
    "id": int,
    "parent": (int, type(None)),
    "kind": str,
    "tokens": int,
    "prefix_tokens": int,
    "subtree_tokens": int,
    "subtree_nodes": int,
    "children": int,
    "text": (str, type(None)),
    "lock_ref": int,
    "pinned": bool,
    "residency": dict,
    "last_access": int,
    "hit_count": int,
    "namespace": (str, type(None)),
}
SAMPLE_KEYS = {
    "seq",
    "t",
    "prompt_tokens",
    "cached_tokens",
    "cached_by_tier",
    "requests",
    "generated_tokens",
    "requests_hit",
    "running",
    "waiting",
    "tiers",
    "evicted_tokens",
    "loads",
    "load_pages",
}


def check_schema(doc: dict[str, Any]) -> None:
    """``doc`` is a version-1 tree view: exact keys and types, parents before children, the node
    budget, and every token and node of the tree accounted for exactly once."""
    assert set(doc) == set(SCHEMA_TOP) == set(TOP_FIELDS)
    for k, t in SCHEMA_TOP.items():
        assert isinstance(doc[k], t), (k, doc[k])
    assert doc["version"] == 1 and doc["text"] in ("show", "hide")
    nodes = doc["nodes"]
    assert nodes[0]["kind"] == "root" and nodes[0]["parent"] is None
    seen: dict[int, dict[str, Any]] = {}
    real = 0
    tokens = 0
    count = 0
    for n in nodes:
        assert set(n) == set(SCHEMA_NODE) == set(NODE_FIELDS), set(n) ^ set(SCHEMA_NODE)
        for k, t in SCHEMA_NODE.items():
            assert isinstance(n[k], t), (k, n[k])
        assert set(n["residency"]) == {"device", "host", "disk", "remote"}
        assert all(isinstance(v, bool) for v in n["residency"].values())
        assert n["kind"] in ("root", "namespace", "node", "more")
        assert n["id"] not in seen
        if n["parent"] is not None:
            parent = seen[n["parent"]]  # parents come first
            assert parent["kind"] != "more"
        if doc["text"] == "hide":
            assert n["text"] is None
        if n["kind"] == "more":
            assert n["id"] < 0 and n["text"] is None
            count += n["subtree_nodes"]
            tokens += n["tokens"]
        else:
            assert n["id"] >= 0
            real += 1
            if n["kind"] != "root":
                count += 1
                tokens += n["tokens"]
                assert n["subtree_tokens"] >= n["tokens"]
        seen[n["id"]] = n
    assert real == doc["shown_nodes"] <= doc["max_nodes"]
    assert count == doc["total_nodes"] and tokens == doc["total_tokens"]
    assert nodes[0]["subtree_tokens"] == doc["total_tokens"]


# ------------------------------------------------------------------------------- tree_view


def words(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


def build_tree(page_size: int = 2) -> RadixTree:
    """A small tree: one hot shared prefix with 3 branches, a cold big branch, two salts, a lock
    and a pin."""
    tree = RadixTree(None, page_size)
    shared = words(20, 100)
    page = 0

    def put(tokens: list[int], salt: Any = None) -> None:
        nonlocal page
        tree.match_prefix(tokens, salt)
        n = len(tokens) // page_size
        tree.insert(tokens, list(range(page, page + n)), salt)
        page += n

    for i in range(3):
        for _ in range(3 - i):  # branch 0 is hit most
            put(shared + words(6, 1000 + 100 * i))
    put(words(60, 5000))  # cold but big
    put(words(8, 7000), salt="tenant-alpha")
    put(words(8, 7000), salt="tenant-beta")
    tree.lock(tree.match_prefix(shared + words(6, 1000)).node)
    tree.pin(words(60, 5000)[:30])
    tree.check_integrity()
    return tree


def decode(ids: Any) -> str:
    return " ".join(f"w{t}" for t in ids)


def test_tree_view_schema_everything_shown() -> None:
    tree = build_tree()
    doc = tree_view(tree, max_nodes=1000, decode=decode, salt_key=b"k")
    check_schema(doc)
    assert doc["total_nodes"] == tree.num_nodes() and doc["shown_nodes"] == tree.num_nodes() + 1
    assert not [n for n in doc["nodes"] if n["kind"] == "more"]
    assert doc["device_tokens"] == tree.total_size and doc["host_tokens"] == 0
    by_prefix = {(n["namespace"], n["prefix_tokens"]): n for n in doc["nodes"]}
    shared = by_prefix[(None, 20)]
    assert shared["tokens"] == 20 and shared["children"] == 3 and shared["parent"] == 0
    assert shared["text"].startswith("w100 w101") and shared["hit_count"] >= 6
    assert shared["lock_ref"] == 1  # the lock on the hot branch counts on its ancestors
    (hot,) = [n for n in doc["nodes"] if n["text"] == decode(words(6, 1000))]
    assert hot["lock_ref"] == 1 and hot["prefix_tokens"] == 26
    pinned = [n for n in doc["nodes"] if n["pinned"]]
    assert len(pinned) == 1 and pinned[0]["prefix_tokens"] == 30 and pinned[0]["lock_ref"] == 1
    assert all(n["residency"]["device"] for n in doc["nodes"] if n["kind"] == "node")
    tree.check_integrity()  # the snapshot changed nothing


def test_tree_view_budget_folds_the_rest_heaviest_first() -> None:
    tree = build_tree()
    for max_nodes in (1, 2, 3, 5):
        doc = tree_view(tree, max_nodes=max_nodes, decode=decode)
        check_schema(doc)
        assert doc["shown_nodes"] == max_nodes
    doc = tree_view(tree, max_nodes=2)
    shown = [n for n in doc["nodes"] if n["kind"] not in ("root", "more")]
    # the 20-token shared prefix (subtree 38 tokens, hit 6+ times) beats the 60-token cold edge
    assert [n["prefix_tokens"] for n in shown] == [20]
    more = [n for n in doc["nodes"] if n["kind"] == "more"]
    assert {m["parent"] for m in more} == {0, shown[0]["id"]}
    root_more = next(m for m in more if m["parent"] == 0)
    assert root_more["children"] == 3 and root_more["tokens"] == 60 + 8 + 8
    assert root_more["lock_ref"] == 1 and root_more["pinned"]  # the pin is in there
    # min_tokens: subtrees under 10 tokens are never shown on their own
    doc = tree_view(tree, max_nodes=100, min_tokens=10)
    check_schema(doc)
    assert all(n["subtree_tokens"] >= 10 for n in doc["nodes"] if n["kind"] == "node")
    assert any(n["kind"] == "more" for n in doc["nodes"])


def test_tree_view_bad_arguments() -> None:
    tree = build_tree()
    with pytest.raises(ValueError, match="max_nodes"):
        tree_view(tree, max_nodes=0)
    with pytest.raises(ValueError, match="min_tokens"):
        tree_view(tree, min_tokens=-1)


def test_tree_view_hides_text_and_salts() -> None:
    tree = build_tree()
    hidden = tree_view(tree, max_nodes=100, decode=None, salt_key=b"secret")
    check_schema(hidden)
    assert hidden["text"] == "hide"
    body = json.dumps(hidden)
    assert "tenant" not in body and "alpha" not in body
    ns = [n for n in hidden["nodes"] if n["kind"] == "namespace"]
    labels = {n["namespace"] for n in ns}
    assert labels == {salt_label("tenant-alpha", b"secret"), salt_label("tenant-beta", b"secret")}
    assert all(re.fullmatch(r"[0-9a-f]{12}", x) for x in labels)
    # every node below a namespace carries its label; the key changes the labels
    for n in hidden["nodes"]:
        if n["kind"] == "node" and n["prefix_tokens"] == 8 and n["parent"] != 0:
            assert n["namespace"] in labels
    other = tree_view(tree, max_nodes=100, salt_key=b"another key")
    assert {n["namespace"] for n in other["nodes"] if n["kind"] == "namespace"}.isdisjoint(labels)
    assert salt_label("x") != salt_label("x", b"k") and salt_label("x") == salt_label("x")


def test_tree_view_residency_of_the_tiers() -> None:
    P = 2
    alloc = BlockAllocator(16, P)
    tree = RadixTree(alloc, P)
    host = HostPool(64, P)
    disk = DiskStore(None, 64 * (HEADER.size + P), b"\0" * 32)
    tiers = TieredCache(tree, alloc, None, host, disk, write_policy="write_through")

    def put(tokens: list[int]) -> None:
        m = tree.match_prefix(tokens)
        tree.lock(m.node)
        need = len(tokens) // P - len(m.pages)
        if need > alloc.num_free:
            tree.evict((need - alloc.num_free) * P)
        new = alloc.allocate(need)
        ret = tree.insert(tokens, m.pages + new)
        if ret // P > len(m.pages):
            alloc.free(new[: ret // P - len(m.pages)])
        tree.unlock(m.node)

    put(words(12, 10))
    disk.sync()
    doc = tree_view(tree, max_nodes=50, tiers=tiers)
    check_schema(doc)
    (node,) = [n for n in doc["nodes"] if n["kind"] == "node"]
    assert node["residency"] == {"device": True, "host": True, "disk": True, "remote": False}
    put(words(24, 500))  # 6 + 12 pages > 16: the first sequence leaves the device
    disk.sync()
    doc = tree_view(tree, max_nodes=50, tiers=tiers)
    check_schema(doc)
    res = {n["prefix_tokens"]: n["residency"] for n in doc["nodes"] if n["kind"] == "node"}
    assert res[12] == {"device": False, "host": True, "disk": True, "remote": False}
    assert res[24]["device"] and res[24]["host"]
    assert doc["host_tokens"] == tree.host_size == 36
    tree.check_integrity()
    tiers.check_integrity()


def test_tree_view_remote_residency() -> None:
    from radixkv.cache.remote_store import RemoteStore

    P = 2
    alloc = BlockAllocator(32, P)
    tree = RadixTree(alloc, P)
    remote = RemoteStore(None, b"\0" * 32, capacity_pages=64)
    tiers = TieredCache(tree, alloc, None, None, None, "write_through", b"\0" * 32, remote=remote)
    pages = alloc.allocate(6)
    tree.insert(words(12, 10), pages)
    doc = tree_view(tree, max_nodes=10, tiers=tiers)
    check_schema(doc)
    (node,) = [n for n in doc["nodes"] if n["kind"] == "node"]
    assert node["residency"] == {"device": True, "host": False, "disk": False, "remote": True}
    without = tree_view(tree, max_nodes=10)  # no tiers given: nothing is looked up
    assert not [n for n in without["nodes"] if n["residency"]["remote"]]
    tree.check_integrity()


# ------------------------------------------------------------------------------- server


def chat(base: str, question: str, headers: dict[str, str], salt: str | None = None) -> Any:
    body: dict[str, Any] = {
        "model": "tiny",
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": question},
        ],
        "max_tokens": 4,
    }
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def shared_prefix_tokens() -> int:
    """Page-aligned common prefix of the two chats' prompts, by the byte tokenizer's template."""
    from bench.tiny_model import ByteTokenizer

    tok = ByteTokenizer()
    a, b = (
        tok.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
            add_generation_prompt=True,
        )
        for q in QUESTIONS
    )
    n = 0
    while a[n] == b[n]:
        n += 1
    return n // PAGE * PAGE


def tiny_engine() -> Any:
    from bench.tiny_model import tiny_loaded_model
    from radixkv.engine.engine import Engine

    return Engine(
        tiny_loaded_model(),
        page_size=PAGE,
        kv_cache_tokens=8192,
        attention_backend="torch",
        dtype="float32",
    )


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    """A live server (real engine, tiny model) with an API key, after two chats that share a
    system prompt."""
    from radixkv.server.app import create_app

    app = create_app(tiny_engine(), api_key=KEY, model_name="tiny")
    with ServerThread(app) as srv:
        auth = {"Authorization": f"Bearer {KEY}"}
        first = chat(srv.base_url, QUESTIONS[0], auth)
        second = chat(srv.base_url, QUESTIONS[1], auth)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == shared_prefix_tokens() > len(SYSTEM)
        srv.app.state.shared = cached  # type: ignore[attr-defined]
        yield srv


def assert_self_contained(html: str) -> None:
    """Nothing in the page loads from elsewhere: no absolute URL in src/href/url()/fetch, no
    @import (the only absolute URL allowed is the SVG namespace name)."""
    assert re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html) is None
    assert re.search(r"""url\(\s*["']?(https?:)?//|@import|fetch\(\s*["']https?:""", html) is None
    assert set(re.findall(r"https?://[^\s\"')]+", html)) <= {"http://www.w3.org/2000/svg"}


def get(srv: ServerThread, path: str, **kw: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}", **kw.pop("headers", {})}
    return httpx.get(f"{srv.base_url}{path}", headers=headers, timeout=30, **kw)


def test_cache_tree_over_http(server: ServerThread) -> None:
    r = get(server, "/cache/tree?max_nodes=50")
    assert r.status_code == 200, r.text
    doc = r.json()
    check_schema(doc)
    shared = server.app.state.shared  # type: ignore[attr-defined]
    (node,) = [n for n in doc["nodes"] if n["kind"] == "node" and n["parent"] == 0]
    assert node["tokens"] == node["prefix_tokens"] == shared and node["children"] == 2
    assert node["text"].startswith(f"<|system|>{SYSTEM[:30]}")
    assert node["hit_count"] >= 1 and node["residency"]["device"]
    assert doc["page_size"] == PAGE and doc["device_tokens"] == doc["total_tokens"]
    # the budget and bad parameters
    one = get(server, "/cache/tree?max_nodes=1").json()
    check_schema(one)
    assert [n["kind"] for n in one["nodes"]] == ["root", "more"]
    for q in ("max_nodes=0", "max_nodes=abc", "min_tokens=-1", "max_nodes=100000"):
        bad = get(server, f"/cache/tree?{q}")
        assert bad.status_code == 400, (q, bad.text)
        assert bad.json()["error"]["param"] in ("query.max_nodes", "query.min_tokens")
    server.app.state.engine_loop.call_sync(lambda e: e.check_integrity())


def test_cache_stats_history(server: ServerThread) -> None:
    # Samples are taken once a second (a poll adds one only when the last is older than half
    # that), so the newest may predate the chats that just finished: wait for one that does not.
    deadline = time.monotonic() + 10
    while True:
        r = get(server, "/cache/stats?history=true")
        assert r.status_code == 200, r.text
        body = r.json()
        if body["history"][-1]["requests"] >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert "running" in body and "hit_rate" in body  # still engine.stats()
    hist = body["history"]
    assert hist and all(set(s) == SAMPLE_KEYS for s in hist)
    seqs = [s["seq"] for s in hist]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    last = hist[-1]
    assert last["requests"] == 2 and last["requests_hit"] == 1
    assert last["cached_tokens"] == server.app.state.shared  # type: ignore[attr-defined]
    assert last["tiers"]["device"]["capacity"] == 8192
    pool = server.app.state.engine.runner.pool  # type: ignore[attr-defined]
    assert last["tiers"]["device"]["kv_dtype"] == str(pool.dtype).removeprefix("torch.")
    assert last["tiers"]["device"]["bytes_per_token"] == pool.bytes_per_page // pool.page_size
    assert last["tiers"]["device"]["cached"] == last["tiers"]["device"]["used"] > 0
    later = get(server, f"/cache/stats?history=true&since={seqs[-1]}").json()["history"]
    assert all(s["seq"] > seqs[-1] for s in later)
    assert "history" not in get(server, "/cache/stats").json()
    server.app.state.history_check = True  # type: ignore[attr-defined]


def test_dashboard_and_tree_need_the_key(server: ServerThread) -> None:
    base = server.base_url
    for path in ("/cache/tree", "/cache/stats?history=true", "/cache/stats"):
        r = httpx.get(f"{base}{path}", timeout=10)
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"
    bearer_wrong = httpx.get(f"{base}/cache/tree", headers={"Authorization": "Bearer x"})
    assert bearer_wrong.status_code == 401
    # the page holds no data: anyone gets it, and it asks for the key (from the URL fragment,
    # which never reaches the server, or a prompt)
    page = httpx.get(f"{base}/dashboard", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "<script>" in page.text and "location.hash" in page.text
    assert SYSTEM not in page.text and KEY not in page.text
    assert_self_contained(page.text)
    # a key in the query string would land in the access log: refused, and not echoed
    in_query = httpx.get(f"{base}/dashboard?key={KEY}", timeout=10)
    assert in_query.status_code == 400 and in_query.json()["error"]["code"] == "key_in_query"
    assert KEY not in in_query.text
    assert "/dashboard" not in httpx.get(f"{base}/openapi.json").text


def test_hidden_text_and_salt_labels() -> None:
    from radixkv.server.app import create_app

    with pytest.raises(ValueError, match="dashboard_text"):
        create_app(object(), dashboard_text="maybe")
    app = create_app(tiny_engine(), model_name="tiny", dashboard_text="hide")
    with ServerThread(app) as srv:
        chat(srv.base_url, QUESTIONS[0], {})
        chat(srv.base_url, QUESTIONS[0], {}, salt="acme-corp-secret-salt")
        body = httpx.get(f"{srv.base_url}/cache/tree", timeout=30).text
        doc = json.loads(body)
        check_schema(doc)
        assert doc["text"] == "hide"
        assert "librarian" not in body and "acme" not in body and "secret" not in body
        (ns,) = [n for n in doc["nodes"] if n["kind"] == "namespace"]
        assert re.fullmatch(r"[0-9a-f]{12}", ns["namespace"])
        below = [n for n in doc["nodes"] if n["parent"] == ns["id"]]
        assert below and all(n["namespace"] == ns["namespace"] for n in below)
        # the same salt keeps its label; the page works without a key when none is set
        again = httpx.get(f"{srv.base_url}/cache/tree", timeout=30).json()
        assert ns["namespace"] in {n["namespace"] for n in again["nodes"]}
        assert httpx.get(f"{srv.base_url}/dashboard", timeout=10).status_code == 200


def test_dashboard_data_is_the_admins_when_keys_are_tenants() -> None:
    """Tenants never see the tree (it holds every tenant's prompts); the admin key does, and
    without an admin key nobody does."""
    from fake_engine import FakeEngine

    from radixkv.server.app import create_app

    for admin_key in (None, "the-admin"):
        app = create_app(
            FakeEngine(),
            api_key=["k1", "k2"],
            admin_key=admin_key,
            salt_from_api_key=True,
            model_name="m",
        )
        with ServerThread(app) as srv:
            for key in ("k1", "k2"):
                r = httpx.get(
                    f"{srv.base_url}/cache/tree", headers={"Authorization": f"Bearer {key}"}
                )
                assert r.status_code == 403, r.text
                assert r.json()["error"]["code"] == "admin_key_required"
            if admin_key is not None:
                r = httpx.get(
                    f"{srv.base_url}/cache/stats?history=true",
                    headers={"Authorization": f"Bearer {admin_key}"},
                )
                assert r.status_code == 200 and "history" in r.json(), r.text


def test_serve_flag_dashboard_text() -> None:
    import argparse

    from radixkv.server.cli import add_serve_parser

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["serve"]).dashboard_text == "show"
    assert parser.parse_args(["serve", "--dashboard-text", "hide"]).dashboard_text == "hide"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--dashboard-text", "nope"])


# ------------------------------------------------------------------------------- simulate --html


def write_trace(path: Path) -> None:
    lines = []
    for i in range(60):
        system = ["travel agent who prefers trains", "code reviewer who is brief"][i % 2]
        text = f"You are a {system} . Question {i % 7} please answer"
        lines.append(json.dumps({"text": text, "output_len": 5}))
    path.write_text("\n".join(lines) + "\n")


def test_simulate_html_report(tmp_path: Path) -> None:
    from radixkv.cli import main

    trace = tmp_path / "trace.jsonl"
    write_trace(trace)
    out = tmp_path / "report.html"
    rc = main(["simulate", "--trace", str(trace), "--capacity-tokens", "120", "--html", str(out)])
    assert rc == 0
    page = out.read_text()
    match = re.search(r"window\.RADIXKV_DATA = (\{.*?\});</script>", page, re.S)
    assert match, "the report data is inlined"
    data = json.loads(match.group(1))
    assert data["stats"]["requests"] == 60
    hist = data["history"]
    assert hist and all(set(s) == SAMPLE_KEYS for s in hist)
    assert hist[-1]["requests"] == 60
    assert hist[-1]["cached_tokens"] == data["stats"]["cached_tokens"] > 0
    assert hist[-1]["evicted_tokens"]["device"] == data["stats"]["evictions"] > 0
    check_schema(data["tree"])
    texts = [n["text"] or "" for n in data["tree"]["nodes"]]
    assert any(t.startswith("You are a") for t in texts)  # words, not ids
    assert_self_contained(page)
    if CHROMIUM:
        dom = render(f"file://{out}", tmp_path, RESULTS / "simulate_report.png")
        nodes = DomNodes.parse(dom)
        assert nodes.kpi("kpi-token-hit") > 0
        assert any(n["snip"].startswith("You are a") for n in nodes.nodes)


def test_simulate_html_needs_one_capacity(tmp_path: Path) -> None:
    from radixkv.cli import main

    trace = tmp_path / "trace.jsonl"
    write_trace(trace)
    rc = main(["simulate", "--trace", str(trace), "--sweep", "10,20", "--html", "x.html"])
    assert rc == 2 and not Path("x.html").exists()


# ------------------------------------------------------------------------------- browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class DomNodes(HTMLParser):
    """The icicle's node divs (attributes and the text of their ``.snip``) and the KPI values
    of a dumped DOM."""

    def __init__(self) -> None:
        super().__init__()
        self.nodes: list[dict[str, Any]] = []
        self.kpis: dict[str, float] = {}
        self.paths: list[str] = []
        self._kpi: str | None = None
        self._snip: dict[str, Any] | None = None

    @classmethod
    def parse(cls, html: str) -> DomNodes:
        p = cls()
        p.feed(html)
        return p

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        cls = a.get("class", "").split()
        if tag == "div" and "node" in cls:
            self.nodes.append({**a, "snip": ""})
        elif tag == "span" and "snip" in cls and self.nodes:
            self._snip = self.nodes[-1]
        elif tag == "div" and "kpi" in cls:
            self._kpi = a.get("id")
        elif tag == "div" and "value" in cls and self._kpi:
            self.kpis[self._kpi] = float(a.get("data-value") or 0)
            self._kpi = None
        elif tag == "path":
            self.paths.append(a.get("class", ""))

    def handle_endtag(self, tag: str) -> None:
        if tag == "span":
            self._snip = None

    def handle_data(self, data: str) -> None:
        if self._snip is not None:
            self._snip["snip"] += data

    def kpi(self, name: str) -> float:
        return self.kpis[name]


def render(url: str, tmp_path: Path, screenshot: Path | None = None) -> str:
    """The DOM of ``url`` after Chromium ran its scripts for 5 s of virtual time (and a
    screenshot, when asked). Nothing is downloaded: background networking is off."""
    assert CHROMIUM
    base = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
        f"--user-data-dir={tmp_path / 'chromium'}",
        "--virtual-time-budget=5000",
        "--window-size=1400,900",
    ]
    if screenshot is not None:
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        shot = subprocess.run(
            [*base, f"--screenshot={screenshot}", url], capture_output=True, timeout=120
        )
        assert shot.returncode == 0, shot.stderr[-2000:]
        assert screenshot.stat().st_size > 10_000
    dom = subprocess.run([*base, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    return dom.stdout


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (setup.sh installs it)")
def test_dashboard_in_a_real_browser(server: ServerThread, tmp_path: Path) -> None:
    # at least two samples, so the chart has lines to draw
    deadline = time.monotonic() + 10
    while len(get(server, "/cache/stats?history=true").json()["history"]) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    url = f"{server.base_url}/dashboard#key={KEY}"
    dom = render(url, tmp_path, RESULTS / "dashboard.png")
    page = DomNodes.parse(dom)
    shared = server.app.state.shared  # type: ignore[attr-defined]
    hits = [
        n
        for n in page.nodes
        if n.get("data-kind") == "node" and n.get("data-tokens") == str(shared)
    ]
    assert hits, f"no node of {shared} tokens in {[n.get('data-tokens') for n in page.nodes]}"
    assert hits[0]["snip"].startswith(f"<|system|>{SYSTEM[:30]}"), hits[0]["snip"]
    assert page.kpi("kpi-token-hit") > 0
    assert page.kpi("kpi-request-hit") == pytest.approx(0.5)
    assert "token" in page.paths and "cumulative" in page.paths
    assert 'class="status live' in dom
    assert KEY not in dom.split("<body", 1)[1]  # the key left the page once read
    if os.environ.get("RADIXKV_DOCS_SCREENSHOT"):
        shutil.copy(RESULTS / "dashboard.png", ROOT / "docs" / "dashboard.png")

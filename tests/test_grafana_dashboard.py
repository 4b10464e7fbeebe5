"""``deploy/grafana-dashboard.json`` (issue 58): every series its queries read is one a radixkv
server's ``/metrics`` serves, with the type the query needs (histograms for
``histogram_quantile``, counters for ``rate``), after some traffic; the JSON is a Grafana
dashboard (panels with unique ids and a Prometheus target each)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
from fake_engine import FakeEngine, ServerThread

from radixkv.server.app import create_app

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana-dashboard.json"
NAME = re.compile(r"\b((?:vllm:|radixkv_|sglang:)[a-zA-Z0-9_:]+)")


def test_every_query_reads_a_series_the_server_serves() -> None:
    dash = json.loads(DASHBOARD.read_text())
    panels = dash["panels"]
    assert len({p["id"] for p in panels}) == len(panels) >= 8
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    assert all(p["targets"] for p in panels)
    with ServerThread(create_app(FakeEngine(), public_metrics=True)) as srv:
        for i in range(3):  # traffic, so every histogram has samples
            r = httpx.post(f"{srv.base_url}/v1/completions", timeout=30,
                           json={"prompt": f"hello there {i}", "max_tokens": 4, "stream": True})  # fmt: skip
            assert r.status_code == 200
        text = httpx.get(f"{srv.base_url}/metrics", timeout=10).text
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    served = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1] != "#"}
    for expr in exprs:
        for name in NAME.findall(expr):
            assert name in served, (name, expr)
            base = re.sub(r"_(bucket|total)$", "", name)
            if name.endswith("_bucket"):
                assert types.get(base) == "histogram", (name, types.get(base))
            if "rate(" in expr and name.endswith("_total"):
                kind = types.get(name) or types.get(base)
                assert kind == "counter", (name, kind)

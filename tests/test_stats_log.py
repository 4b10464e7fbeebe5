"""The periodic stats line: its numbers come from two samples, it is logged while the server is
busy, and an idle server logs nothing."""

from __future__ import annotations

import time

import httpx
import pytest
from fake_engine import FakeEngine, ServerThread

from radixkv.server.app import create_app
from radixkv.server.stats_log import StatsLine, format_stats_line


def sample(t: float, prompt: int, cached: int, generated: int, running: int = 0) -> dict:
    return {
        "t": t,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "generated_tokens": generated,
        "running": running,
        "waiting": 0,
        "tiers": {"device": {"used": 300, "cached": 100, "capacity": 1000}},
    }


def test_the_line_is_the_difference_of_two_samples() -> None:
    line = format_stats_line(sample(0, 100, 10, 0), sample(10, 600, 260, 250, running=2))
    assert line == (
        "prompt 50.0 tok/s, generation 25.0 tok/s, running 2, waiting 0, KV pool 30.0% used "
        "(10.0% cached prefixes), prefix-cache hit rate 50.0% (last 10 s)"
    )
    stats = StatsLine(interval=10)
    assert stats.observe(sample(0, 0, 0, 0)) is None
    assert stats.observe(sample(5, 50, 0, 5, running=1)) is None  # not due yet
    assert stats.observe(sample(10, 100, 0, 10, running=1)) is not None
    assert stats.observe(sample(20, 100, 0, 10)) is None  # idle: nothing logged
    with pytest.raises(ValueError):
        StatsLine(interval=0)


def test_a_busy_server_logs_stats_lines(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="radixkv.server.stats")
    engine = FakeEngine(step_delay=0.01)
    app = create_app(engine, model_name="m", log_stats_interval=1.0)
    with ServerThread(app) as srv:
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            body = {"prompt": "some traffic", "max_tokens": 8}
            assert httpx.post(f"{srv.base_url}/v1/completions", json=body).status_code == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "radixkv.server.stats"]
    assert lines and "generation" in lines[0] and "tok/s" in lines[0], lines

"""The short soak: ``bench.soak`` for ~20 s on the tiny model, server in a child process.

Mixed chat / completions / ``/generate`` traffic, streaming and not, ``n`` up to 3, shared and
fresh prompts under several salts, a third of the streams dropped, client timeouts, flushes and
TTL pins while busy, against a device pool so small that eviction, host/disk tier traffic and
preemption never stop. No server error, no leaked page, integrity holds, the server stays up.
(The 5-minute SmolLM2 run is ``python -m bench.soak --minutes 5``; its figures are in README.)
"""

from __future__ import annotations

import pytest

from bench.soak import run_soak


@pytest.mark.slow
def test_short_soak_tiny_model(tmp_path) -> None:
    report = run_soak(0.3, tiny=True, concurrency=6, seed=1, log_path=str(tmp_path / "server.log"))
    log = (tmp_path / "server.log").read_text(errors="replace")[-3000:]
    assert not report["server_errors"], (report["server_error_examples"], log)
    assert report["leaked_pages"] == 0 and report["leaked_host_pages"] == 0, report
    assert report["integrity_ok"], (report["integrity_error"], log)
    assert report["health_at_end"] == 200
    assert report["passed"]
    assert report["requests_served"] > 30, report
    # the hostile parts happened
    assert report["client_caused"].get("stream_dropped", 0) > 0, report
    # and the pressure was real: preemption, host and disk tier traffic
    assert report["preemptions"] > 0, report
    assert report["host_writes"] > 0 and report["disk_write_pages"] > 0, report
    assert report["server_exit"] is not None

"""The short soak with faults (``bench.soak --faults``'s CI variant): two tiny-model replicas with
host, shared-disk and Redis tiers behind ``radixkv router``, mixed traffic, and during it Redis
killed and restarted, the disk tier's filesystem filled and freed (a tmpfs, where this host lets
us mount one), replica 1 killed and restarted. No wrong greedy answer, no unclear failure, no
failure outside the replica kill, no leaked page, integrity on every replica. (RSS is reported
but judged only on the long run: a minute has not reached its steady state.)"""

from __future__ import annotations

import shutil

import pytest

from bench.soak_faults import run_fault_soak


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")
def test_short_soak_with_faults(tmp_path) -> None:
    report = run_fault_soak(
        1.2, tiny=True, concurrency=6, seed=3, log_dir=str(tmp_path), rss_growth_limit_pct=None
    )
    logs = {p.name: p.read_text(errors="replace")[-2000:] for p in tmp_path.glob("*.log")}
    assert report["wrong_answers"] == 0, report["wrong_examples"]
    assert report["unclear_failures"] == 0, (report["error_examples"], logs)
    assert report["failures_outside_replica_kills"] == 0, (report["error_examples"], logs)
    assert report["leaked_pages"] == 0 and report["integrity_ok"], report["integrity_errors"]
    assert report["idle_at_end"] and report["passed"], report
    events = [e["event"] for e in report["fault_events"]]
    want = ["redis_killed", "redis_restarted", "replica_killed", "replica_restarted"]
    if report["disk_tmpfs"] == "mounted":
        want[2:2] = ["disk_filled", "disk_freed"]
    assert events == want, report["fault_events"]
    # traffic ran through every window, and the greedy checks compared answers
    windows = report["by_window"]
    for window in ("none", "redis_down", "replica_killed"):
        assert sum(windows.get(window, {}).values()) > 5, (window, windows)
    assert report["greedy_checks"]["same"] > 10, report["greedy_checks"]
    assert report["outcomes"].get("stream_dropped", 0) > 0
    assert any(k.startswith("pin_200") for k in report["outcomes"]), report["outcomes"]
    if report["disk_tmpfs"] == "mounted":
        assert "No space left" in logs.get("replica0.log", "") + logs.get("replica1.log", "")

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from radixkv.cli import main
from radixkv.sim.simulator import RESULT_KEYS, hash_tokenize, prepare_trace, simulate
from radixkv.sim.workloads import generated_shared_prefix, multi_turn, write_jsonl


def _lcp(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def reference_hits(trace: list[dict], page_size: int) -> int:
    """Sum over requests of the longest page-aligned prefix shared with anything cached before
    (earlier prompts plus their output_ids), by brute force."""
    P = page_size
    seen: list[tuple[object, list[int]]] = []
    total = 0
    for r in trace:
        prompt = r["input_ids"]
        best = 0
        for salt, seq in seen:
            if salt == r.get("salt"):
                k = _lcp(prompt[: len(prompt) // P * P], seq[: len(seq) // P * P])
                best = max(best, k // P * P)
        total += best
        seen.append((r.get("salt"), prompt + r.get("output_ids", [])))
    return total


def test_unbounded_hits_equal_longest_shared_prefix_page1() -> None:
    # small vocab so questions also share a few leading tokens by chance
    trace = generated_shared_prefix(5, 6, 12, 6, 0, seed=7, vocab_range=(0, 3), num_salts=2)
    res = simulate(trace, None, page_size=1)
    assert res["cached_tokens"] == reference_hits(trace, 1)
    assert res["prompt_tokens"] == sum(len(r["input_ids"]) for r in trace)
    assert res["token_hit_rate"] == res["optimal_hit_rate"]
    assert res["evictions"] == 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_multi_turn_outputs_are_inserted(page_size: int) -> None:
    trace = multi_turn(4, 3, 5, 3, shared_system_prompt_len=6, seed=2, vocab_range=(0, 4))
    res = simulate(trace, None, page_size=page_size)
    assert res["cached_tokens"] == reference_hits(trace, page_size)
    assert set(res) == set(RESULT_KEYS)


def test_fresh_outputs_never_hit() -> None:
    trace = [{"input_ids": [1, 2, 3], "output_len": 2}, {"input_ids": [1, 2, 3, 4, 5]}]
    reqs = prepare_trace(trace)
    assert reqs[0].seq[:3] == [1, 2, 3] and all(t < 0 for t in reqs[0].seq[3:])
    assert simulate(reqs, None)["cached_tokens"] == 3


def test_bounded_capacity_evicts_and_lowers_hit_rate() -> None:
    trace = generated_shared_prefix(8, 4, 64, 16, 8, seed=0)
    full = simulate(trace, None, page_size=4)
    small = simulate(trace, 200, page_size=4, policy="lru")
    assert small["evictions"] > 0
    assert small["token_hit_rate"] < full["token_hit_rate"] == small["optimal_hit_rate"]
    assert small["tokens_per_second"] > 0
    # a request bigger than the whole pool still replays (caching only what fits)
    tiny = simulate(trace, 8, page_size=4, policy="fifo")
    assert tiny["requests"] == 32


def test_text_requests_use_hash_tokenizer() -> None:
    assert hash_tokenize("a b  a\nc") == hash_tokenize("a b a c")
    t = hash_tokenize("a b a")
    assert t[0] == t[2] != t[1]
    trace = [{"text": "one two three"}, {"text": "one two four"}]
    assert simulate(trace, 100)["cached_tokens"] == 2
    with pytest.raises(ValueError, match="neither"):
        prepare_trace([{"id": "x"}])


def test_cli_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = generated_shared_prefix(4, 4, 32, 8, 4, seed=0)
    path = tmp_path / "t.jsonl"
    write_jsonl(trace, path)
    rc = main(
        [
            "simulate",
            "--trace",
            str(path),
            "--capacity-tokens",
            "100",
            "--page-size",
            "4",
            "--policy",
            "lfu",
            "--json",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == list(RESULT_KEYS)
    expected = simulate(trace, 100, 4, "lfu")
    assert {k: out[k] for k in RESULT_KEYS if k != "tokens_per_second"} == {
        k: expected[k] for k in RESULT_KEYS if k != "tokens_per_second"
    }
    assert main(["simulate", "--trace", str(path), "--capacity-tokens", "100"]) == 0
    assert "token_hit_rate" in capsys.readouterr().out
    assert (
        main(["simulate", "--trace", str(tmp_path / "missing.jsonl"), "--capacity-tokens", "1"])
        == 2
    )
    assert main(["simulate", "--trace", str(path)]) == 2


def test_cli_sweep_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    write_jsonl(generated_shared_prefix(4, 4, 32, 8, 4, seed=0), path)
    png = tmp_path / "sweep.png"
    rc = main(
        ["simulate", "--trace", str(path), "--sweep", "64,128,512", "--plot", str(png), "--json"]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["sweep"]) == 9 and {r["policy"] for r in out["sweep"]} == {"lru", "lfu", "fifo"}
    rates = [r["token_hit_rate"] for r in out["sweep"] if r["policy"] == "lru"]
    assert rates == sorted(rates)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_does_not_import_torch(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    write_jsonl([{"input_ids": [1, 2, 3]}, {"input_ids": [1, 2]}], path)
    code = (
        "import sys; from radixkv.cli import main; "
        f"assert main(['simulate', '--trace', {str(path)!r}, '--capacity-tokens', '8', '--json']) == 0; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["cached_tokens"] == 2


@pytest.mark.parametrize("page_size", [1, 2])
def test_duplicate_pages_beyond_the_prompt_are_freed(page_size: int) -> None:
    # the second request's output is already cached past its prompt: insert reports more
    # present tokens than were matched, and the replay must free those duplicate pages
    # (replay raises on a page leak)
    trace = [
        {"input_ids": [1, 2, 3, 4, 5, 6, 7, 8]},
        {"input_ids": [1, 2, 3, 4], "output_ids": [5, 6, 7, 8]},
        {"input_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]},
    ]
    res = simulate(trace, 64, page_size=page_size)
    assert res["cached_tokens"] == 4 + 8

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from radixkv.sim import workloads
from radixkv.sim.workloads import (
    WORDS,
    few_shot,
    generated_shared_prefix,
    multi_turn,
    read_jsonl,
    write_jsonl,
)


def test_words_distinct() -> None:
    assert len(WORDS) == len(set(WORDS)) > 1000
    assert all(w.isalpha() and w.islower() for w in WORDS)


def test_generated_shared_prefix_shape_and_determinism() -> None:
    reqs = generated_shared_prefix(4, 3, 20, 5, 7, seed=1, vocab_range=(10, 50))
    assert reqs == generated_shared_prefix(4, 3, 20, 5, 7, seed=1, vocab_range=(10, 50))
    assert reqs != generated_shared_prefix(4, 3, 20, 5, 7, seed=2, vocab_range=(10, 50))
    assert [r["id"] for r in reqs] == list(range(12))
    assert all(len(r["input_ids"]) == 25 and r["output_len"] == 7 for r in reqs)
    assert all(10 <= t < 50 for r in reqs for t in r["input_ids"])
    assert all(r["arrival"] == 0 for r in reqs)
    systems = {tuple(r["input_ids"][:20]) for r in reqs}
    assert len(systems) == 4
    for s in systems:
        assert sum(tuple(r["input_ids"][:20]) == s for r in reqs) == 3
    # shuffled: not grouped in generation order
    firsts = [tuple(r["input_ids"][:20]) for r in reqs]
    assert firsts != sorted(firsts, key=firsts.index)


def test_text_mode_and_salts_and_arrivals() -> None:
    reqs = generated_shared_prefix(2, 2, 6, 3, 4, seed=0, text=True, num_salts=2, request_rate=10)
    assert all(len(r["text"].split()) == 9 and "input_ids" not in r for r in reqs)
    assert {r["salt"] for r in reqs} == {"tenant-0", "tenant-1"}
    arrivals = [r["arrival"] for r in reqs]
    assert arrivals == sorted(arrivals) and arrivals[-1] > 0


def test_multi_turn_prompts_contain_history() -> None:
    reqs = multi_turn(3, 3, 4, 5, shared_system_prompt_len=2, seed=0)
    assert len(reqs) == 9
    by_client: dict[tuple, list] = {}
    for r in reqs:
        by_client.setdefault(tuple(r["input_ids"][:6]), []).append(r)
    assert len(by_client) == 3
    for convo in by_client.values():
        convo.sort(key=lambda r: len(r["input_ids"]))
        for prev, nxt in zip(convo, convo[1:]):
            full = prev["input_ids"] + prev["output_ids"]
            assert nxt["input_ids"][: len(full)] == full
            assert len(nxt["input_ids"]) == len(full) + 4
        assert all(len(r["output_ids"]) == 5 for r in convo)
    # all clients share the system prompt
    assert len({tuple(r["input_ids"][:2]) for r in reqs}) == 1
    text = multi_turn(2, 2, 3, 3, seed=0, text=True)
    second = [r for r in text if len(r["text"].split()) > 3]
    assert all("output_text" in r for r in text) and len(second) == 2


def test_few_shot_shares_examples() -> None:
    reqs = few_shot(5, 3, 4, 6, 2, seed=3)
    assert all(len(r["input_ids"]) == 3 * 8 + 6 for r in reqs)
    assert len({tuple(r["input_ids"][:24]) for r in reqs}) == 1
    text = few_shot(2, 2, 3, 3, seed=3, text=True)
    assert text[0]["text"].startswith("Translate English to French.")
    assert text[0]["text"].rstrip().endswith("French:")


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="vocab_range"):
        generated_shared_prefix(1, 1, 1, 1, 1, vocab_range=(5, 5))
    with pytest.raises(ValueError, match="request_rate"):
        few_shot(1, request_rate=0)


def test_jsonl_roundtrip_and_cli(tmp_path: Path) -> None:
    reqs = few_shot(3, 1, 2, 2, 1, seed=0)
    path = tmp_path / "t.jsonl"
    assert write_jsonl(reqs, path) == 3
    assert read_jsonl(path) == reqs
    out = tmp_path / "gsp.jsonl"
    args = [
        "generated-shared-prefix",
        "--seed",
        "5",
        "--output",
        str(out),
        "--num-groups",
        "2",
        "--prompts-per-group",
        "3",
        "--system-prompt-len",
        "8",
        "--question-len",
        "2",
    ]
    repo = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        [sys.executable, "-m", "bench.workloads", *args],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "wrote 6 requests" in proc.stderr
    lines = out.read_text().splitlines()
    assert len(lines) == 6
    expected = workloads.generated_shared_prefix(2, 3, 8, 2, 256, seed=5)
    assert [json.loads(x) for x in lines] == expected
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 0}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_jsonl(bad)

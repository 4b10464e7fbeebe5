"""The decode-step benchmark's lockstep pairing (bench/bench_step.py), on stand-in engines."""

from __future__ import annotations

import pytest

from bench.bench_step import lockstep_full_batch_steps, paired_ratio


class SteppedEngine:
    """Admits its requests on the first step, has them all running until the last two steps."""

    def __init__(self, name: str, steps: int, log: list[str]) -> None:
        self.name, self.total, self.log = name, steps, log
        self.done = 0
        self.requests = 0

    def add_request(self, rid: str, prompt: list[int], params: object) -> None:
        self.requests += 1

    def has_unfinished(self) -> bool:
        return self.done < self.total

    def step(self) -> None:
        self.log.append(self.name)
        self.done += 1

    def stats(self) -> dict[str, int]:
        running = self.requests if 1 <= self.done <= self.total - 2 else self.requests // 2
        return {"running": running, "waiting": 0}


def test_lockstep_pairs_full_batch_rounds_and_rotates_the_order() -> None:
    log: list[str] = []
    engines = {n: SteppedEngine(n, 20, log) for n in ("a", "b", "c")}
    got = lockstep_full_batch_steps(engines, [[1]] * 4, None, rotation=1)
    # full rounds: steps 1..18 of 20 (done counted after the step), less the first 3, last 2
    assert [len(v) for v in got.values()] == [18 - 5] * 3
    assert all(t >= 0 for v in got.values() for t in v)
    rounds = [log[i : i + 3] for i in range(0, len(log), 3)]
    assert len(rounds) == 20
    for i, r in enumerate(rounds):  # every engine once a round, the first moving on each round
        assert sorted(r) == ["a", "b", "c"]
        assert r[0] == "abc"[(1 + i) % 3]


def test_lockstep_stops_pairing_when_an_engine_runs_dry() -> None:
    log: list[str] = []
    engines = {"a": SteppedEngine("a", 20, log), "b": SteppedEngine("b", 12, log)}
    got = lockstep_full_batch_steps(engines, [[1]] * 4, None)
    assert len(got["a"]) == len(got["b"]) == 10 - 5  # b's full rounds bound the pairs
    assert log.count("a") == 20 and log.count("b") == 12


def test_paired_ratio_is_the_median_of_ratios_with_an_interval_around_it() -> None:
    base = [100.0, 200.0, 50.0, 80.0, 120.0] * 8
    other = [b * r for b, r in zip(base, [0.9, 0.95, 1.0, 0.92, 0.94] * 8, strict=True)]
    ratio, low, high = paired_ratio(base, other)
    assert ratio == pytest.approx(0.94)
    assert 0.9 <= low <= ratio <= high <= 1.0
    assert paired_ratio(base, base) == (1.0, 1.0, 1.0)
    with pytest.raises(ValueError):
        paired_ratio(base, other[:-1])

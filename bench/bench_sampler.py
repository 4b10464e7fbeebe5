"""Cost of the batched sampler (radixkv.engine.sampler) per decode step, side by side.

For batch sizes 1, 8 and 64 over SmolLM2's vocabulary (49,152), and several settings (the
default temperature 1.0 that vLLM's client sends, temperature + top-p, top-k, min-p, penalties
over a 800-token history, a mix of all with greedy rows), prints the median time of one
``Sampler.sample`` call for the whole batch, the same rows sampled one at a time (the shape of
round 2's per-row loop), the ratio, the greedy argmax floor, and the batch with the plain rows
(temperature only) drawn by torch ops instead of the native ``sample_rows`` ("torch draw";
the same where every row filters or is penalised past the native path). ``--baseline-rev REV`` also
times the sampler of an earlier commit (its ``radixkv/engine/sampling.py``, read with ``git
show``; round 2's is ``d3fe5cf``) on the same logits, and prints its time and the ratio. The
host's ISA is printed.

Run from the repository root: ``python -m bench.bench_sampler`` (``--iters N``,
``--baseline-rev d3fe5cf``).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable

import torch

from radixkv.engine.sampler import Sampler, SequenceState
from radixkv.engine.sampling import SamplingParams
from radixkv.model import native

VOCAB = 49_152
HISTORY = 800

SETTINGS: dict[str, Callable[[int], SamplingParams]] = {
    "default T=1": lambda i: SamplingParams(temperature=1.0, seed=i),
    "T=0.7 top-p 0.9": lambda i: SamplingParams(temperature=0.7, top_p=0.9, seed=i),
    "top-k 50": lambda i: SamplingParams(temperature=1.0, top_k=50, seed=i),
    "min-p 0.05": lambda i: SamplingParams(temperature=1.0, min_p=0.05, seed=i),
    "penalties": lambda i: SamplingParams(
        temperature=1.0, repetition_penalty=1.1, frequency_penalty=0.2, seed=i
    ),
    "mixed": lambda i: [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, seed=i),
        SamplingParams(temperature=0.8, top_p=0.95, top_k=40, seed=i),
        SamplingParams(temperature=1.0, presence_penalty=0.5, seed=i),
    ][i % 4],
}


def median_ms(fn: Callable[[], object], iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def time_case(
    sampler: Sampler, logits: torch.Tensor, states: list[SequenceState], iters: int
) -> tuple[float, float]:
    """(batched ms, one-row-at-a-time ms) for one step over ``logits``."""
    rows = [logits[i : i + 1] for i in range(len(states))]
    batched = median_ms(lambda: sampler.sample(logits, states), iters)
    per_row = median_ms(
        lambda: [sampler.sample(r, [s]) for r, s in zip(rows, states)], max(3, iters // 4)
    )
    return batched, per_row


def baseline_module(rev: str) -> types.ModuleType:
    """``radixkv/engine/sampling.py`` as it was at ``rev`` (its Sampler, SequenceState and
    SamplingParams), loaded beside the current one."""
    source = subprocess.run(
        ["git", "show", f"{rev}:radixkv/engine/sampling.py"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    module = types.ModuleType(f"sampling_at_{rev}")
    sys.modules[module.__name__] = module  # dataclasses look their module up there
    exec(compile(source, f"{rev}:radixkv/engine/sampling.py", "exec"), module.__dict__)
    return module


def baseline_states(old: types.ModuleType, states: list[SequenceState]) -> list:
    """The same sequences as the baseline sampler's ``SequenceState``s."""
    fields = [f.name for f in dataclasses.fields(old.SamplingParams)]
    return [
        old.SequenceState(
            old.SamplingParams(**{f: getattr(s.params, f) for f in fields}),
            s.prompt_ids,
            s.output_ids,
        )
        for s in states
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--baseline-rev", help="also time the sampler of this commit")
    args = parser.parse_args()
    old = baseline_module(args.baseline_rev) if args.baseline_rev else None
    print(f"host ISA: {native.host_isa()}, torch threads: {torch.get_num_threads()}")
    g = torch.Generator().manual_seed(0)
    sampler, torch_draw = Sampler(), Sampler(kernels=None)
    print(
        f"native draw: {'yes' if native.load() is not None else 'no (' + str(native.build_error()) + ')'}"
    )
    header = f"{'setting':18} {'batch':>5} {'batched ms':>11} {'per-row ms':>11} {'ratio':>6}"
    header += f" {'argmax':>7} {'torch draw':>10}" + (
        f" {args.baseline_rev + ' ms':>12} {'ratio':>6}" if old else ""
    )
    print(header)
    for batch in (1, 8, 64):
        logits = torch.randn(batch, VOCAB, generator=g) * 4
        history = torch.randint(0, VOCAB, (batch, HISTORY), generator=g).tolist()
        floor = median_ms(lambda x=logits: x.argmax(-1).tolist(), args.iters)
        for name, make in SETTINGS.items():
            states = [
                SequenceState(make(i), history[i][:700], history[i][700:]) for i in range(batch)
            ]
            batched, per_row = time_case(sampler, logits, states, args.iters)
            slow = median_ms(lambda x=logits, st=states: torch_draw.sample(x, st), args.iters)
            line = (
                f"{name:18} {batch:5d} {batched:11.2f} {per_row:11.2f} "
                f"{per_row / batched:6.1f} {floor:7.2f} {slow:10.2f}"
            )
            if old is not None:
                then = median_ms(
                    lambda x=logits, st=baseline_states(old, states): old.Sampler().sample(x, st),
                    max(3, args.iters // 4),
                )
                line += f" {then:12.2f} {then / batched:6.1f}"
            print(line)


if __name__ == "__main__":
    main()

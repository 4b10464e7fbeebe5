"""KV pages held by a k-beam search vs k independent greedy sequences of the same length.

    .venv/bin/python -m bench.bench_beam [--beams 4 --max-tokens 48 --page-size 16 --model smollm2]

Every run starts from an empty cache and generates ``max_tokens`` tokens per sequence
(``ignore_eos``, so all runs have the same length). After every engine step the bench records
the pages held by live sequences (the distinct pages of their page tables, shared ones counted
once) and the allocator's used pages; it prints the peaks of both, side by side:

* ``beam``: one request, ``use_beam_search=True, n=k`` (beams fork over shared pages);
* ``greedy x k, no sharing``: k requests of the same prompt, prefix cache off (independent);
* ``greedy x k, shared prompt``: the same with the prefix cache on (the prompt's full pages are
  shared through the tree, each answer has its own pages).

A page count does not depend on the host or on timing, so nothing here runs under a lock.
"""

from __future__ import annotations

import argparse
from typing import Any

from radixkv import Engine, SamplingParams

PROMPT = (
    "Write one sentence about the history of the city of Vienna, its river, its palaces, its "
    "coffee houses and its music, for a travel brochure aimed at first-time visitors."
)


def peak_pages(engine: Engine, prompt: Any, params: list[SamplingParams]) -> dict[str, int]:
    """Run one request per ``params`` to completion; peak pages held by live sequences and peak
    allocator pages in use, checking the engine's integrity after every step."""
    for i, p in enumerate(params):
        engine.add_request(f"peak-{i}", prompt, p)
    live_peak = used_peak = 0
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
        live = {page for s in engine.scheduler.running for page in s.pages}
        live_peak = max(live_peak, len(live))
        used_peak = max(used_peak, engine.allocator.num_used)
    return {"live_pages": live_peak, "used_pages": used_peak}


def compare(loaded: Any, beams: int, max_tokens: int, page_size: int) -> dict[str, dict]:
    """The three runs of the module docstring on fresh engines; returns their peaks."""
    knobs: dict[str, Any] = dict(page_size=page_size, kv_cache_tokens=8192, dtype="float32")
    prompt = PROMPT if getattr(loaded, "tokenizer", None) is not None else list(range(3, 60))
    beam = SamplingParams(n=beams, use_beam_search=True, max_tokens=max_tokens, ignore_eos=True)
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    out = {
        "beam": peak_pages(Engine(loaded, **knobs), prompt, [beam]),
        "greedy_independent": peak_pages(
            Engine(loaded, enable_prefix_cache=False, **knobs), prompt, [greedy] * beams
        ),
        "greedy_shared_prompt": peak_pages(Engine(loaded, **knobs), prompt, [greedy] * beams),
    }
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--page-size", type=int, default=16)
    args = ap.parse_args(argv)
    import torch

    from radixkv.model.loader import load_model

    loaded = load_model(args.model, dtype=torch.float32)
    res = compare(loaded, args.beams, args.max_tokens, args.page_size)
    k = args.beams
    print(f"model={args.model} beams={k} max_tokens={args.max_tokens} page_size={args.page_size}")
    print(f"{'run':<28}{'peak live pages':>16}{'peak used pages':>17}")
    names = {
        "beam": f"beam search k={k}",
        "greedy_independent": f"greedy x{k}, no sharing",
        "greedy_shared_prompt": f"greedy x{k}, shared prompt",
    }
    for key, label in names.items():
        r = res[key]
        print(f"{label:<28}{r['live_pages']:>16}{r['used_pages']:>17}")
    b = res["beam"]["live_pages"]
    for key in ("greedy_independent", "greedy_shared_prompt"):
        print(f"beam / {names[key]}: {b / res[key]['live_pages']:.2f}x live pages")


if __name__ == "__main__":
    main()

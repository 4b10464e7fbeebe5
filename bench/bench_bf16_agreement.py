"""Greedy agreement of radixkv in bfloat16 with radixkv in float32 on the real model.

bfloat16 is the default dtype where the CPU has native bf16 (AVX512-BF16 / AMX); float32 is the
exact path, held to transformers' float64 forward by the test suite's precision contract
(``tests/oracle.py``). This prints how often bf16 greedy decoding picks the same tokens as fp32 on
chat prompts through the chat template: identical continuations, per-token agreement up to each
sequence's first divergence, and the mean position of the first divergence. For scale, the same
for transformers' own bf16 forward (``generate``, greedy) against radixkv's fp32 tokens: how far
bf16 arithmetic itself moves this model's greedy choices.

Run from the repository root: ``python -m bench.bench_bf16_agreement`` (``--tokens N``,
``--prompts N``). The host's ISA is printed.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from radixkv import Engine, SamplingParams
from radixkv.model import native
from radixkv.model.loader import load_model

TOPICS = [
    "why the sky is blue",
    "how a radix tree stores strings",
    "the causes of the French Revolution",
    "how to bake sourdough bread",
    "what a hash table is",
    "the life cycle of a star",
    "how vaccines train the immune system",
    "the rules of chess for a beginner",
    "why cats purr",
    "how compound interest works",
    "the plot of Hamlet",
    "how a CPU cache works",
    "what photosynthesis does",
    "how to learn a new language",
    "the history of the bicycle",
    "how rainbows form",
]


def greedy(dtype: torch.dtype, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    model = load_model("smollm2", dtype=dtype)
    engine = Engine(model, dtype=str(dtype).removeprefix("torch."))
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for step in engine.step():
            out[step.request_id].extend(step.new_token_ids)
    return [out[f"r{i}"] for i in range(len(prompts))]


def hf_greedy(dtype: torch.dtype, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one at a time, EOS ignored."""
    hf = load_model("smollm2", dtype=dtype).hf_model
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            got = hf.generate(
                ids,
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                do_sample=False,
                attention_mask=torch.ones_like(ids),
            )
            outs.append(got[0, len(prompt) :].tolist())
    return outs


def divergence(ref: list[list[int]], other: list[list[int]], tokens: int) -> str:
    firsts = [
        next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        for a, b in zip(ref, other)
    ]
    same = sum(d == tokens for d in firsts)
    return (
        f"{same}/{len(ref)} identical; first divergence at token {statistics.mean(firsts):.1f} "
        f"on average (median {statistics.median(firsts):.0f}); tokens equal before the first "
        f"divergence: {sum(firsts)}/{len(ref) * tokens}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=len(TOPICS))
    args = parser.parse_args()
    print(f"host ISA: {native.host_isa()}, torch threads: {torch.get_num_threads()}")
    tokenizer = load_model("smollm2", dtype=torch.float32).tokenizer
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Explain {topic}."}],
            add_generation_prompt=True,
            tokenize=False,
        )
        for topic in (TOPICS * (1 + args.prompts // len(TOPICS)))[: args.prompts]
    ]
    prompts = [list(tokenizer.encode(t, add_special_tokens=False)) for t in texts]
    fp32 = greedy(torch.float32, prompts, args.tokens)
    bf16 = greedy(torch.bfloat16, prompts, args.tokens)
    head = f"{len(prompts)} chat prompts x {args.tokens} greedy tokens, against radixkv fp32"
    print(f"{head}:\n  radixkv bf16:      {divergence(fp32, bf16, args.tokens)}")
    hf = hf_greedy(torch.bfloat16, prompts, args.tokens)
    print(f"  transformers bf16: {divergence(fp32, hf, args.tokens)}")


if __name__ == "__main__":
    main()

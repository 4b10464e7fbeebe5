"""The batch-64 decode step on a GPU, with bf16, int8 and fp8_e4m3 KV pages, side by side.

SmolLM2-135M's geometry (30 layers, hidden 576, 9 query / 3 KV heads of 64, vocab 49,152) with
random weights (the step's cost does not depend on their values, and the GGUF does not travel to
a lent GPU), bf16, ``ModelRunner`` with the Triton backend. Issue 31's shape: 64 requests of
4 x 768 shared + 64 own prompt tokens (each request's pages its own: the Triton kernels read every
request's whole context), then decode steps; the median step time per KV dtype, interleaved over
``--runs`` rounds, and each quantized dtype's ratio to bf16 pages. Also checks, per KV dtype, that
the greedy tokens of the first decode steps are finite and mostly agree with bf16 pages.

Run from the repository root on a CUDA machine: ``python -m bench.bench_gpu_step``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def smollm2_config():  # noqa: ANN201 - a transformers LlamaConfig
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    )


def run_dtype(
    kv_cache_dtype: str,
    state: dict,
    batch: int,
    steps: int,
    prompts: list[list[int]],
    device: str = "cuda",
) -> tuple[list[float], list[list[int]]]:
    """Prefill ``prompts``, then ``steps`` greedy decode steps; per-step ms and the tokens."""
    from radixkv.model.runner import ModelRunner, RequestSlice

    cfg = smollm2_config()
    page = 16
    max_len = max(len(p) for p in prompts) + steps + 1
    pages_per = -(-max_len // page)
    runner = ModelRunner(
        cfg,
        state,
        num_pages=batch * pages_per + 1,
        page_size=page,
        dtype=torch.bfloat16,
        device=device,
        attention_backend="triton" if device == "cuda" else None,
        kv_cache_dtype=kv_cache_dtype,
    )
    pages = [list(range(1 + b * pages_per, 1 + (b + 1) * pages_per)) for b in range(batch)]
    seqs = [list(p) for p in prompts]
    chunk = 8  # prefill 8 requests a step
    last: list[int] = []
    for s in range(0, batch, chunk):
        out = runner.forward(
            runner.build_batch(
                [RequestSlice(seqs[b], 0, pages[b]) for b in range(s, min(batch, s + chunk))]
            )
        )
        last += out.argmax(-1).tolist()
    for b in range(batch):
        seqs[b].append(last[b])
    times: list[float] = []
    for _ in range(steps):
        reqs = [RequestSlice(seqs[b][-1:], len(seqs[b]) - 1, pages[b]) for b in range(batch)]
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fb = runner.build_batch(reqs)
        out = runner.forward(fb)
        nxt = out.argmax(-1).tolist()  # the host needs the tokens: this syncs
        times.append((time.perf_counter() - t0) * 1e3)
        assert torch.isfinite(out).all(), f"{kv_cache_dtype}: non-finite logits"
        for b in range(batch):
            seqs[b].append(nxt[b])
    del runner
    if device == "cuda":
        torch.cuda.empty_cache()
    return times, [s[len(p) :] for s, p in zip(seqs, prompts, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--device", default="cuda", help="cpu: a smoke run of this script (native kernels)"
    )
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_gpu_step needs a CUDA device (or --device cpu for a smoke run)")
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    cfg = smollm2_config()
    state = LlamaForCausalLM(cfg).to(torch.bfloat16).state_dict()
    g = torch.Generator().manual_seed(0)
    shared = [torch.randint(0, 49152, (768,), generator=g).tolist() for _ in range(4)]
    prompts = [
        shared[b % 4] + torch.randint(0, 49152, (64,), generator=g).tolist()
        for b in range(args.batch)
    ]
    kinds = ["auto", "int8", "fp8_e4m3"]
    medians: dict[str, list[float]] = {k: [] for k in kinds}
    tokens: dict[str, list[list[int]]] = {}
    print(
        f"device: {torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}, torch {torch.__version__}; SmolLM2 geometry, "
        f"random bf16 weights, batch {args.batch}, 4 x 768 shared + 64 own, {args.steps} steps"
    )
    for r in range(args.runs):
        for k in kinds:
            times, toks = run_dtype(k, state, args.batch, args.steps, prompts, args.device)
            medians[k].append(statistics.median(times[2:]))
            tokens.setdefault(k, toks)
            print(f"run {r}: kv {k:9s} median step {medians[k][-1]:7.2f} ms")
    base = statistics.median(medians["auto"])
    for k in kinds:
        m = statistics.median(medians[k])
        same = sum(t[:8] == u[:8] for t, u in zip(tokens[k], tokens["auto"], strict=True))
        print(
            f"kv {k:9s}: step {m:7.2f} ms ({m / base:.3f}x bf16 pages); first 8 greedy tokens "
            f"identical to bf16 pages in {same}/{args.batch} requests"
        )


if __name__ == "__main__":
    main()

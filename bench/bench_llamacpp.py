"""Latency against llama.cpp: time to first token and time per output token, 1 / 4 / 8 users.

Both engines run the same GGUF file (the default: SmolLM2-135M-Instruct Q4_1, the packaged
default model) on the same token ids: each user's prompt is one shared system prompt plus a
question of its own, rendered with the model's chat template by radixkv's tokenizer and handed to
both as ids; greedy, EOS ignored, ``--max-tokens`` each. The users arrive together.

- **radixkv**: ``Engine(gguf)`` through its Python API, in the host's default dtype unless
  ``--dtype`` says (radixkv dequantizes a GGUF's weights on load). Shared prefixes are computed
  once (its radix cache).
- **radixkv-gguf**: the same with ``quantization="gguf"``: the file's own quantized blocks,
  multiplied without dequantizing the matrices (radixkv/model/gguf_quantized.py), activations
  in the same dtype (weights-only quantization, radixkv's default).
- **radixkv-gguf-int8**: the same with ``RADIXKV_QUANT_ACTIVATIONS=int8``: decode rows'
  activations quantized per 32-block to int8 and multiplied by integer dot products, llama.cpp's
  own scheme (opt-in in radixkv: bf16-class precision, radixkv/model/quant_linear.py).
- **radixkv-gguf-int8x2**: ``RADIXKV_QUANT_ACTIVATIONS=int8x2``: decode rows (1-4) as two int8
  terms, x's codes and the codes of what they leave, both products summed (opt-in: error below
  bf16's, within the bf16 contract on SmolLM2; 5-8 rows take the float path).
  ``--engines`` picks the engines (default: all five).
- **llama.cpp**: llama-cpp-python's low-level API (``llama_decode`` over one batch holding every
  user's row), the file's own quantization. It is given the same sharing: the system prompt is
  decoded once into sequence 0 and copied to the others (``llama_memory_seq_cp``), then every
  user's question in one batch, then one token per user per step. Its greedy pick is the argmax
  of the row's logits.

Each repeat of each (engine, users) case runs in a fresh process, a warm-up round (untimed, its
own system prompt) and then the timed round; the engines' order alternates from one repeat to the
next, so a drift in the host's load falls on both. Each repeat uses a new system prompt (neither
engine has it cached). Per
user: TTFT = first token's time since the requests were given; TPOT = (last - first) / (n - 1).
Printed: the medians over users and repeats, and radixkv / llama.cpp for each. The threads are
the same for both (``--threads``, default: the cores torch sees). Then batch 1's floor for each
engine: the bytes of weights its step reads (every linear in the layout its kernel reads;
llama.cpp: the file's blocks, as radixkv-gguf counts them) over the host's streaming read
bandwidth (a large float32 tensor sum, before and after the runs), and TPOT over that floor.

llama-cpp-python is not a dependency of radixkv. ``--build`` makes a wheel from its sdist (PyPI,
pinned :data:`LLAMA_CPP_VERSION`) with explicit ISA flags read from ``/proc/cpuinfo``
(``GGML_NATIVE`` builds died with SIGILL on some VMs) and installs it into this environment.

Run from the repository root: ``python -m bench.bench_llamacpp [--build] [--users 1,4,8]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

LLAMA_CPP_VERSION = "0.3.36"
SYSTEM = (
    "You are a concise assistant for a travel company. Answer in one short paragraph, name the "
    "season and one practical tip, and never invent prices. Session {rep}."
)
QUESTIONS = (
    "What should I pack for a week in Lisbon?",
    "Is Kyoto worth visiting in winter?",
    "How do I get from the airport to central Oslo?",
    "What is a good day trip from Florence?",
    "Which month is best for hiking in Patagonia?",
    "How many days do I need for Istanbul?",
    "Can I see the northern lights from Reykjavik?",
    "What food should I try in Oaxaca?",
)


#: the flags a wheel's build depends on (its cache folder is named by them)
_GGML_FLAGS = {"avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile"}


def cpu_flags() -> set[str]:
    """The host's ISA flags from ``/proc/cpuinfo`` (empty where it is missing)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def ggml_cmake_args(flags: set[str]) -> str:
    """CMake flags for llama.cpp with this host's ISA spelled out (``GGML_NATIVE`` off)."""
    on = {
        "GGML_AVX": "avx" in flags,
        "GGML_AVX2": "avx2" in flags,
        "GGML_FMA": "fma" in flags,
        "GGML_F16C": "f16c" in flags,
        "GGML_AVX512": "avx512f" in flags,
        "GGML_AVX512_VBMI": "avx512vbmi" in flags,
        "GGML_AVX512_VNNI": "avx512_vnni" in flags,
        "GGML_AVX512_BF16": "avx512_bf16" in flags,
        "GGML_AVX_VNNI": "avx_vnni" in flags,
        "GGML_AMX_TILE": "amx_tile" in flags,
        "GGML_AMX_INT8": "amx_int8" in flags,
        "GGML_AMX_BF16": "amx_bf16" in flags,
    }
    parts = ["-DGGML_NATIVE=OFF", "-DLLAMA_CURL=OFF", "-DGGML_OPENMP=ON"]
    parts += [f"-D{name}={'ON' if v else 'OFF'}" for name, v in on.items()]
    return " ".join(parts)


def build_llama_cpp() -> None:
    """Build llama-cpp-python from its sdist with this host's ISA flags and install it here."""
    root = Path(os.environ.get("RADIXKV_CACHE_DIR", Path.home() / ".cache" / "radixkv"))
    tag = "-".join(sorted(cpu_flags() & _GGML_FLAGS)) or "generic"
    wheels = root / "llama-cpp-wheels" / f"{LLAMA_CPP_VERSION}-{tag}"
    wheels.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip"]
    if not any(wheels.glob("llama_cpp_python-*.whl")):
        env = {**os.environ, "CMAKE_ARGS": ggml_cmake_args(cpu_flags())}
        print(f"building llama-cpp-python {LLAMA_CPP_VERSION}: CMAKE_ARGS={env['CMAKE_ARGS']}")
        spec = f"llama-cpp-python=={LLAMA_CPP_VERSION}"
        subprocess.run(
            [
                *pip,
                "wheel",
                "--no-deps",
                "--no-binary",
                "llama-cpp-python",
                spec,
                "-w",
                str(wheels),
            ],
            env=env,
            check=True,
        )
    wheel = sorted(wheels.glob("llama_cpp_python-*.whl"))[-1]
    subprocess.run([*pip, "install", str(wheel)], check=True)  # with numpy, diskcache, jinja2


def prompts(tokenizer: Any, users: int, rep: int) -> list[list[int]]:
    """Each user's chat prompt as token ids: the shared system prompt, then its own question."""
    out = []
    for u in range(users):
        messages = [
            {"role": "system", "content": SYSTEM.format(rep=rep)},
            {"role": "user", "content": QUESTIONS[u % len(QUESTIONS)]},
        ]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))  # BatchEncoding
    return out


def shared_prefix(rows: list[list[int]]) -> int:
    """Length of the prefix every row shares."""
    n = min(len(r) for r in rows)
    for i in range(n):
        if any(r[i] != rows[0][i] for r in rows):
            return i
    return n


def per_user(stamps: list[list[float]], start: float) -> tuple[list[float], list[float]]:
    """TTFT and TPOT (seconds) of each user from its tokens' times."""
    ttft = [s[0] - start for s in stamps]
    tpot = [(s[-1] - s[0]) / (len(s) - 1) for s in stamps if len(s) > 1]
    return ttft, tpot


def run_radixkv(
    gguf: str,
    rounds: list[list[list[int]]],
    max_tokens: int,
    dtype: str,
    quantization: str | None = None,
) -> dict:
    """TTFT / TPOT of radixkv's engine over the rounds (first round untimed) and its tokens."""
    from radixkv import Engine, SamplingParams

    knobs: dict[str, Any] = {"max_running_requests": max(8, len(rounds[0]))}
    if quantization:
        knobs["quantization"] = quantization
    if dtype != "auto":
        knobs["dtype"] = dtype
    engine = Engine(gguf, **knobs)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ttft: list[float] = []
    tpot: list[float] = []
    tokens: list[int] = []
    for r, rows in enumerate(rounds):
        stamps: list[list[float]] = [[] for _ in rows]
        first_tokens: list[int] = []
        start = time.perf_counter()
        for u, ids in enumerate(rows):
            engine.add_request(f"{r}-{u}", ids, params)
        while engine.has_unfinished():
            outs = engine.step()
            now = time.perf_counter()
            for o in outs:
                u = int(o.request_id.split("-")[1])
                stamps[u].extend(now for _ in o.new_token_ids)
                if u == 0:
                    first_tokens.extend(o.new_token_ids)
        if r:
            a, b = per_user(stamps, start)
            ttft += a
            tpot += b
            tokens = first_tokens
    weights = step_weight_bytes(engine.runner.model)
    engine.close()
    return {
        "ttft": ttft,
        "tpot": tpot,
        "tokens": tokens,
        "dtype": str(engine.runner.dtype),
        "weight_bytes": weights,
    }


def step_weight_bytes(model: Any) -> int:
    """Bytes of weights a decode step reads: every linear's (the layers' projections and the
    head) in the layout its kernel reads (GGUF blocks, the packed float copy, or the plain
    weight); norms and the one embedding row are left out (< 0.1%)."""
    import torch

    from radixkv.model.linear import PackedLinear
    from radixkv.model.quant_linear import QuantLinear

    total = 0
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            total += mod.nbytes
        elif isinstance(mod, PackedLinear):
            total += mod.packed.numel() * mod.packed.element_size()
        elif isinstance(mod, torch.nn.Linear):
            total += mod.weight.numel() * mod.weight.element_size()
    return total


def run_llama_cpp(gguf: str, rounds: list[list[list[int]]], max_tokens: int, threads: int) -> dict:
    """The same rounds through llama.cpp's batch API, the system prompt decoded once."""
    import ctypes

    import llama_cpp as lc
    import numpy as np

    lc.llama_backend_init()
    mparams = lc.llama_model_default_params()
    model = lc.llama_model_load_from_file(gguf.encode(), mparams)
    users = len(rounds[0])
    longest = max(len(r) for rows in rounds for r in rows)
    cparams = lc.llama_context_default_params()
    cparams.n_ctx = (longest + max_tokens + 8) * users
    cparams.n_batch = cparams.n_ubatch = max(512, longest * users)
    cparams.n_seq_max = users
    cparams.n_threads = cparams.n_threads_batch = threads
    if hasattr(cparams, "kv_unified"):
        cparams.kv_unified = True
    ctx = lc.llama_init_from_model(model, cparams)
    vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    memory = lc.llama_get_memory(ctx)
    batch = lc.llama_batch_init(cparams.n_batch, 0, users)

    def decode(rows: list[tuple[int, int, int, bool]]) -> None:
        """rows: (token, position, sequence, wants logits)."""
        for i, (tok, pos, seq, logits) in enumerate(rows):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, logits
        batch.n_tokens = len(rows)
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def argmax(i: int) -> int:
        ptr = lc.llama_get_logits_ith(ctx, i)
        row = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), (vocab,))
        return int(row.argmax())

    ttft: list[float] = []
    tpot: list[float] = []
    tokens: list[int] = []
    for r, rows in enumerate(rounds):
        lc.llama_memory_clear(memory, True)
        shared = min(shared_prefix(rows), min(len(x) for x in rows) - 1)
        stamps: list[list[float]] = [[] for _ in rows]
        start = time.perf_counter()
        decode([(t, p, 0, False) for p, t in enumerate(rows[0][:shared])])
        for u in range(1, users):
            lc.llama_memory_seq_cp(memory, 0, u, -1, -1)
        tails = [
            (t, p, u, p == len(x) - 1)
            for u, x in enumerate(rows)
            for p, t in enumerate(x)
            if p >= shared
        ]
        decode(tails)
        last = [i for i, row in enumerate(tails) if row[3]]
        picks = [argmax(i) for i in last]
        now = time.perf_counter()
        positions = [len(x) for x in rows]
        outs: list[list[int]] = [[p] for p in picks]
        for s in stamps:
            s.append(now)
        for _ in range(max_tokens - 1):
            decode([(outs[u][-1], positions[u], u, True) for u in range(users)])
            picks = [argmax(u) for u in range(users)]
            now = time.perf_counter()
            for u in range(users):
                outs[u].append(picks[u])
                positions[u] += 1
                stamps[u].append(now)
        if r:
            a, b = per_user(stamps, start)
            ttft += a
            tpot += b
            tokens = outs[0]
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    lc.llama_model_free(model)
    return {"ttft": ttft, "tpot": tpot, "tokens": tokens, "dtype": "gguf"}


def worker(args: argparse.Namespace) -> None:
    """One case in this process: prints its result as JSON on the last line."""
    rounds = json.loads(Path(args.rounds_file).read_text())
    if args.worker.startswith("radixkv"):
        quantization = "gguf" if args.worker.startswith("radixkv-gguf") else None
        if args.worker in ACTIVATIONS:  # read as the layers are built
            os.environ["RADIXKV_QUANT_ACTIVATIONS"] = ACTIVATIONS[args.worker]
        result = run_radixkv(args.gguf, rounds, args.max_tokens, args.dtype, quantization)
    else:
        result = run_llama_cpp(args.gguf, rounds, args.max_tokens, args.threads)
    print(json.dumps(result))


ENGINES = ("llamacpp", "radixkv", "radixkv-gguf", "radixkv-gguf-int8", "radixkv-gguf-int8x2")
#: the engines that set ``RADIXKV_QUANT_ACTIVATIONS``, and to what
ACTIVATIONS = {"radixkv-gguf-int8": "int8", "radixkv-gguf-int8x2": "int8x2"}


def run_worker(name: str, rounds: list, gguf: str, args: argparse.Namespace) -> dict:
    """One engine over ``rounds`` (a warm-up, then the timed ones) in a fresh process."""
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(rounds, f)
        f.flush()
        cmd = [sys.executable, "-m", "bench.bench_llamacpp", "--worker", name]
        cmd += ["--gguf", gguf, "--rounds-file", f.name, "--dtype", args.dtype]
        cmd += ["--max-tokens", str(args.max_tokens), "--threads", str(args.threads)]
        out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"{name} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", default=None, help="GGUF file (default: SmolLM2 Q4_1)")
    parser.add_argument("--users", default="1,4,8")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="auto", help="radixkv's dtype (auto: the host's)")
    parser.add_argument("--threads", type=int, default=0, help="0: torch's thread count")
    parser.add_argument("--build", action="store_true", help="build llama-cpp-python first")
    parser.add_argument(
        "--engines", default=",".join(ENGINES), help=f"comma-separated, of {', '.join(ENGINES)}"
    )
    parser.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--rounds-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    engines = tuple(e for e in ENGINES if e in args.engines.split(","))
    if "llamacpp" not in engines or len(engines) < 2:
        sys.exit(f"--engines: llamacpp and at least one radixkv engine ({', '.join(ENGINES)})")
    import torch

    args.threads = args.threads or torch.get_num_threads()
    if args.worker:
        torch.set_num_threads(args.threads)
        worker(args)
        return
    if args.build:
        build_llama_cpp()
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        sys.exit("llama-cpp-python is not installed: run with --build (builds it from its sdist)")
    from radixkv.model import native
    from radixkv.model.loader import load_model, smollm2_gguf_path

    gguf = args.gguf or str(smollm2_gguf_path())
    tokenizer = load_model(gguf, hf_model=False).tokenizer
    print(f"host ISA: {native.host_isa()}, threads: {args.threads}, GGUF: {Path(gguf).name}")
    print(f"max_tokens {args.max_tokens}, repeats {args.repeats} (+1 warm-up), greedy, EOS ignored")
    from bench.bench_w1 import read_bandwidth_gbs

    bandwidth = [read_bandwidth_gbs()]
    rows = []
    for users in (int(u) for u in args.users.split(",")):
        rounds = [prompts(tokenizer, users, rep) for rep in range(args.repeats + 1)]
        res: dict[str, dict] = {n: {"ttft": [], "tpot": [], "tokens": []} for n in engines}
        for rep in range(1, args.repeats + 1):
            for name in engines if rep % 2 else engines[::-1]:
                got = run_worker(name, [rounds[0], rounds[rep]], gguf, args)
                for key in ("ttft", "tpot"):
                    res[name][key] += got[key]
                res[name]["tokens"] = res[name]["tokens"] or got["tokens"]
                res[name]["dtype"] = got["dtype"]
                res[name]["weight_bytes"] = got.get("weight_bytes")
        agree = {n: agreed(res[n]["tokens"], res["llamacpp"]["tokens"]) for n in engines[1:]}
        prompt_len = len(rounds[1][0])
        shared = shared_prefix(rounds[1])
        rows.append((users, prompt_len, shared, res, agree))
    print_table(rows, engines[1:], args.max_tokens)
    bandwidth.append(read_bandwidth_gbs())
    print_floors(rows, engines, bandwidth)


def print_floors(rows: list, engines: tuple[str, ...], bandwidth: list[float]) -> None:
    """Batch 1's floor per engine: the weights a step reads at the host's streaming read
    bandwidth (a large tensor sum's, before and after the runs; the faster one), and the
    median TPOT over it. llama.cpp reads the file's blocks, radixkv-gguf's bytes."""
    one = next((r for r in rows if r[0] == 1), None)
    if one is None:
        return
    res = one[3]
    gbs = max(bandwidth)
    print(
        f"\nbatch-1 floors: read bandwidth {bandwidth[0]:.1f} / {bandwidth[1]:.1f} GB/s "
        f"(before / after the runs; a float32 sum over 512 MiB), floor = weights / {gbs:.1f} GB/s"
    )
    blocks = next((res[n]["weight_bytes"] for n in engines if n.startswith("radixkv-gguf")), None)
    for n in engines:
        weights = blocks if n == "llamacpp" else res[n].get("weight_bytes")
        if not weights:
            continue
        floor = weights / (gbs * 1e9) * 1e3
        tpot = statistics.median(res[n]["tpot"]) * 1e3
        print(
            f"  {n}: {weights / 1e6:.1f} MB -> floor {floor:.2f} ms; TPOT {tpot:.2f} ms = "
            f"{tpot / floor:.2f}x the floor"
        )


def agreed(tokens: list[int], reference: list[int]) -> int:
    """How many leading greedy tokens equal the reference's."""
    n = 0
    for a, b in zip(tokens, reference, strict=False):
        if a != b:
            break
        n += 1
    return n


def print_table(rows: list, ours: tuple[str, ...], max_tokens: int) -> None:
    """One row per user count: llama.cpp's TTFT and TPOT, then each radixkv engine's with its
    ratio to llama.cpp's, and how many greedy tokens agree."""
    head = "| users | prompt (shared) | llama.cpp TTFT ms | llama.cpp TPOT ms |"
    for n in ours:
        head += f" {n} TTFT ms | ratio | {n} TPOT ms | ratio | greedy agree |"
    print("\n" + head)
    print("|" + " --- |" * (head.count("|") - 1))
    for users, prompt_len, shared, res, agree in rows:
        ttft = {n: statistics.median(res[n]["ttft"]) * 1e3 for n in res}
        tpot = {n: statistics.median(res[n]["tpot"]) * 1e3 for n in res}
        line = f"| {users} | {prompt_len} ({shared}) | {ttft['llamacpp']:.1f} | {tpot['llamacpp']:.2f} |"
        for n in ours:
            line += (
                f" {ttft[n]:.1f} | {ttft[n] / ttft['llamacpp']:.2f}x | {tpot[n]:.2f} "
                f"| {tpot[n] / tpot['llamacpp']:.2f}x | {agree[n]}/{max_tokens} |"
            )
        print(line)
    dtypes = ", ".join(f"{n} {rows[0][3][n]['dtype']}" for n in ours)
    print(f"dtype: {dtypes}; ratio: radixkv / llama.cpp")


if __name__ == "__main__":
    main()

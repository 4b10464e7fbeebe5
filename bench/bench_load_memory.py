"""Peak memory of loading a model into radixkv, against the size of its weights.

    .venv/bin/python -m bench.bench_load_memory [--model smollm2] [--tiny largest] [--dtype float32]

Each case runs in a fresh process: its resident set after importing torch, transformers and
radixkv and loading a tiny model the same way (libraries, native kernels and code paths warm) is
the baseline; then ``ModelRunner(load_model(...))`` builds the model (with a KV pool of
one page per layer, so the pool does not count) and the process reports its peak resident set
(``ru_maxrss``). Printed: the weights' bytes in the dtype (parameters, a tied head counted once),
the load's peak above the baseline, and their ratio; plus the resident set left after the load.
``--tiny NAMES`` (comma-separated) also saves tiny random models of tests/architectures.py (a
directory of safetensors each, as a user's checkpoint) and loads them: ``largest`` (the default)
is the one with the most weight bytes, ``all`` every architecture, ``""`` none. The GGUF model is read from radixkv's weight cache (a
safetensors directory made on its first load), as every load after the first.
``--quantization gguf`` loads the GGUF in its own quantization instead (radixkv/model/
gguf_quantized.py; the warm-up a tiny Q4_1 GGUF) and judges the peak against the file's size,
with the metadata cache warm and without it; ``build`` is the model's own part, the peak over
the resident set once the tokenizer and config are loaded (a 49k-vocabulary tokenizer holds
~15 MiB whatever the weights).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

CHILD = r"""
import json, resource, sys
import torch, transformers  # noqa: F401  (the baseline includes the libraries)
import radixkv.model.runner as runner_mod
from radixkv.model.loader import load_model

def rss_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])

name, dtype, stream = sys.argv[1], getattr(torch, sys.argv[2]), sys.argv[3] == "1"
quant = sys.argv[5] or None
def load(model):
    return load_model(model, dtype=dtype, hf_model=not stream, quantization=quant)
# warm up every library, the native kernels and the code path on a tiny model first, so the
# baseline holds what any load costs whatever its size
warm = runner_mod.ModelRunner(load(sys.argv[4]), num_pages=2, page_size=16, dtype=dtype,
                              quantization=quant)
del warm
import gc; gc.collect()
base = rss_kib()
# the baseline's peak so far: the load's peak must be read above it, so reset the high-water mark
open("/proc/self/clear_refs", "w").write("5")
def hwm_kib():
    return int([l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0].split()[1])

loaded = load(name)
# the model's build apart from the tokenizer's and config's load: the high-water mark so far
# noted, then reset (the heap the load freed given back first, so it is not counted as held)
from radixkv.model.placement import trim_heap
gc.collect(); trim_heap()
loaded_kib, load_hwm = rss_kib(), hwm_kib()
open("/proc/self/clear_refs", "w").write("5")
runner = runner_mod.ModelRunner(loaded, num_pages=2, page_size=16, dtype=dtype, quantization=quant)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
build_hwm = hwm_kib()
hwm = max(load_hwm, build_hwm)
if quant == "gguf":  # the quantized bytes the file holds (the norms are a few KiB of it)
    weights = loaded.weights.path.stat().st_size
else:
    params = {id(p): p for p in runner.model.parameters()}
    weights = sum(p.numel() * p.element_size() for p in params.values())
print(json.dumps({"base_kib": base, "peak_kib": max(hwm, 0), "after_kib": rss_kib(),
                  "loaded_kib": loaded_kib, "build_peak_kib": build_hwm,
                  "weights_bytes": weights, "maxrss_kib": peak}))
"""


def measure(
    name: str,
    dtype: str,
    stream: bool,
    warmup: str,
    quantization: str | None = None,
    env: dict[str, str] | None = None,
) -> dict:
    """One load in a fresh process (``quantization="gguf"``: ``name`` and ``warmup`` are GGUF
    files served in their own quantization; ``weights_bytes`` is then the file's size)."""
    args = [name, dtype, "1" if stream else "0", warmup, quantization or ""]
    out = subprocess.run(
        [sys.executable, "-c", CHILD, *args],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **(env or {})},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def tiny_gguf(where: Path) -> str:
    """A tiny Llama 3 written as a Q4_1 GGUF (tests/gguf_files.py): the gguf mode's warm-up."""
    from architectures import tiny_model
    from gguf_files import write_gguf

    path = where / "tiny-llama3.Q4_1.gguf"
    write_gguf(tiny_model("llama3", intermediate_size=128), path, "Q4_1")
    return str(path)


def gguf_mode(model: str, dtype: str) -> None:
    """``--quantization gguf``: the model's GGUF (``smollm2``: the packaged one) loaded in its own
    quantization, once with its metadata cache warm (every load after the first) and once with
    ``RADIXKV_NO_WEIGHT_CACHE=1`` (transformers reads the metadata: what a first load costs)."""
    with tempfile.TemporaryDirectory() as root:
        warmup = tiny_gguf(Path(root))
        measure(model, dtype, True, warmup, "gguf")  # makes the metadata cache
        print(
            f"{'model':<28} {'metadata':<10} {'file MiB':>11} {'peak-base MiB':>13} "
            f"{'ratio':>6} {'after-base MiB':>14} {'build MiB':>9} {'ratio':>6}"
        )
        for label, env in (("cached", {}), ("read", {"RADIXKV_NO_WEIGHT_CACHE": "1"})):
            r = measure(model, dtype, True, warmup, "gguf", env)
            w = r["weights_bytes"] / 2**20
            peak = (r["peak_kib"] - r["base_kib"]) / 1024
            after = (r["after_kib"] - r["base_kib"]) / 1024
            build = (r["build_peak_kib"] - r["loaded_kib"]) / 1024
            print(
                f"{model + ' gguf':<28} {label:<10} {w:>11.1f} {peak:>13.1f} {peak / w:>6.2f} "
                f"{after:>14.1f} {build:>9.1f} {build / w:>6.2f}"
            )


def tiny_names(spec: str, configs: dict, build: Callable[[str], Any]) -> list[str]:
    """The tiny architectures ``--tiny`` names: ``largest`` (most parameters), ``all``, or a list."""
    if spec == "all":
        return list(configs)
    if spec == "largest":
        sizes = {n: sum(p.numel() for p in build(n).parameters()) for n in configs}
        return [max(sizes, key=sizes.__getitem__)]
    names = [n for n in spec.split(",") if n]
    unknown = sorted(set(names) - set(configs))
    if unknown:
        raise SystemExit(f"unknown tiny architecture(s) {unknown}; choices: {', '.join(configs)}")
    return names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument(
        "--tiny", default="largest", help="tiny architectures to load too: largest, all or names"
    )
    ap.add_argument("--dtype", default="float32")
    ap.add_argument(
        "--quantization",
        choices=["gguf"],
        help="gguf: the GGUF model served in its own quantization (peak against the file's size)",
    )
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    if args.quantization == "gguf":
        gguf_mode(args.model, args.dtype)
        return
    from architectures import CONFIGS, tiny_model

    from bench.tiny_model import byte_level_hf_tokenizer

    tiny = tiny_names(args.tiny, CONFIGS, tiny_model)
    with tempfile.TemporaryDirectory() as root:
        dirs = {name: str(Path(root) / name) for name in ("llama3", *tiny)}
        for name, where in dirs.items():
            tiny_model(name).save_pretrained(where)
            byte_level_hf_tokenizer().save_pretrained(where)
        cases = {args.model: args.model, **{f"tiny {n}": dirs[n] for n in tiny}}
        print(
            f"{'model':<28} {'loader':<10} {'weights MiB':>11} {'peak-base MiB':>13} "
            f"{'ratio':>6} {'after-base MiB':>14}"
        )
        warmup = dirs["llama3"]
        for label, name in cases.items():
            for stream in (False, True):
                r = measure(name, args.dtype, stream, warmup)
                w = r["weights_bytes"] / 2**20
                peak = (r["peak_kib"] - r["base_kib"]) / 1024
                after = (r["after_kib"] - r["base_kib"]) / 1024
                print(
                    f"{label:<28} {'streamed' if stream else 'hf model':<10} {w:>11.1f} "
                    f"{peak:>13.1f} {peak / w:>6.2f} {after:>14.1f}"
                )


if __name__ == "__main__":
    main()

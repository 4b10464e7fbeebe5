"""Sliding-window models through the engine's runner against transformers' float64 forward: a
prompt several windows long prefilled in chunks (each chunk an extend after a cached prefix),
then decodes, in steps that also carry a second request whose prompt hits the first one's
cached pages mid-prompt, on every kernel path this host runs (native kernels at every ISA level,
the torch backends) and the Triton backend (the GPU, else its interpreter). Mistral (every layer
windowed, head dim 128), Gemma 3 (local and global layers, head dim 256), Phi-3 (head dim 80) and
Mixtral (every layer windowed, routed experts).
The native and Triton backends attend the windowed layers in their kernels; the torch backends
through :mod:`radixkv.model.attention.window`: each test checks which one ran."""

from __future__ import annotations

import pytest
import torch
from architectures import WINDOW, tiny_model
from kernel_paths import assert_runs_path, bf16_paths, fp32_paths, use_path
from oracle import BF16, FP32, Oracle, check_rows
from test_model import TRITON_DEVICE, PageDealer

from radixkv.model import llama
from radixkv.model.runner import ModelRunner, RequestSlice

PAGE = 16
CHUNK = 24  # prefill chunk: the window (20) and the page (16) fall inside chunks
CASES = [pytest.param(FP32, p, id=f"fp32-{p}") for p in fp32_paths()] + [
    pytest.param(BF16, p, id=f"bf16-{p}") for p in bf16_paths()
]


@pytest.fixture(scope="module", params=["mistral", "gemma3", "phi3", "mixtral"])
def windowed(request):
    model = tiny_model(request.param)
    oracle = Oracle(model)
    g = torch.Generator().manual_seed(1)
    a = torch.randint(0, 256, (4 * CHUNK - 5,), generator=g).tolist()  # 91 tokens
    a = a + oracle.greedy(a, 3)
    # b: a's first 3 pages, then its own tokens (a cache hit mid-prompt, 3 windows in)
    b = a[: 3 * PAGE] + torch.randint(0, 256, (30,), generator=g).tolist()
    return request.param, model, oracle, a, b


def run_steps(runner: ModelRunner, a: list[int], b: list[int]) -> dict[str, torch.Tensor]:
    """A's prompt in chunks of CHUNK, then its 3 decodes; from A's second decode on, B (its
    first 3 pages A's) in the same steps: its uncached part in one extend, then a decode. The
    logits rows of every position each request ran, by request."""
    dealer = PageDealer(runner.num_pages, 3)
    pages_a = dealer.take(-(-len(a) // PAGE) + 1)
    pages_b = pages_a[:3] + dealer.take(-(-len(b) // PAGE))
    rows: dict[str, list[torch.Tensor]] = {"A": [], "B": []}
    prompt = len(a) - 3
    for start in range(0, prompt, CHUNK):
        ids = a[start : min(start + CHUNK, prompt)]
        batch = runner.build_batch([RequestSlice(ids, start, pages_a)])
        rows["A"].extend(runner.forward(batch, True))
    b_pos = 3 * PAGE
    for pos in range(prompt, len(a)):
        reqs = [RequestSlice(a[pos : pos + 1], pos, pages_a)]
        if pos > prompt and b_pos < len(b):
            end = len(b) - 1 if b_pos == 3 * PAGE else b_pos + 1
            reqs.append(RequestSlice(b[b_pos:end], b_pos, pages_b))
            b_pos = end
        out = runner.forward(runner.build_batch(reqs), True)
        rows["A"].append(out[0])
        rows["B"].extend(out[1:])
    return {name: torch.stack(r) for name, r in rows.items()}


def judge(rows, oracle, a, b, contract, label):
    for name, seq, at in (("A", a, slice(0, len(a))), ("B", b, slice(3 * 16, len(b)))):
        truth = oracle.logits(seq)[at]
        refs = [r[at] for r in oracle.references(seq, contract.dtype)]
        check_rows(rows[name], truth, refs, contract, label, f"request {name} logits")


def count_torch_windows(monkeypatch) -> list[int]:
    """Counts the calls of the torch gather (radixkv.model.attention.window) from the layers."""
    calls = [0]
    real = llama.windowed_attention

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(llama, "windowed_attention", counted)
    return calls


@pytest.mark.parametrize("contract, path", CASES)
def test_chunked_prefill_cache_hit_and_decodes_match_the_oracle(
    windowed, contract, path, monkeypatch
):
    name, model, oracle, a, b = windowed
    use_path(path, monkeypatch)
    runner = ModelRunner(model, num_pages=32, page_size=PAGE, dtype=contract.dtype)
    assert_runs_path(runner.backend, path, runner.config.head_dim)
    calls = count_torch_windows(monkeypatch)
    assert len(b) - 3 * PAGE > WINDOW and len(a) > 4 * WINDOW  # the windows bind
    judge(run_steps(runner, a, b), oracle, a, b, contract, f"{path} {name}")
    # the native kernels take the window; the torch backends gather it (window.py)
    assert (calls[0] == 0) == (path.isa is not None), calls[0]


def test_triton_backend_attends_the_windows_in_its_kernels(windowed, monkeypatch):
    """float32 through the Triton backend (windows and head dims 80, 128, 256 in its kernels)."""
    name, model, oracle, a, b = windowed
    runner = ModelRunner(
        model,
        num_pages=32,
        page_size=PAGE,
        dtype=torch.float32,
        attention_backend="triton",
        device=TRITON_DEVICE,
    )
    assert runner.backend.windows_in_kernel
    calls = count_torch_windows(monkeypatch)
    rows = {k: v.cpu() for k, v in run_steps(runner, a, b).items()}
    judge(rows, oracle, a, b, FP32, f"triton {name}")
    assert calls[0] == 0

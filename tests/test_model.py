"""Our paged forward pass against transformers (tiny random Llama and the real SmolLM2)."""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass

import pytest
import torch
from kernel_paths import assert_runs_path, bf16_paths, fp32_paths, use_path
from oracle import (
    BF16,
    FP32,
    Contract,
    Oracle,
    check_greedy_tokens,
    check_rows,
    onednn_available,
)

from radixkv.model import native
from radixkv.model.attention.base import torch_store_kvcache
from radixkv.model.attention.torch_backend import torch_decode_attention, torch_extend_attention
from radixkv.model.kv_pool import KVPool
from radixkv.model.kv_quant import dequantize
from radixkv.model.runner import ModelRunner, RequestSlice

PAGE = 16
# The Triton backend runs on the GPU where there is one, else under TRITON_INTERPRET=1 on the CPU
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def hf_last_logits(hf_model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits of the last token of ``ids``."""
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0, -1].float()


class PageDealer:
    """Hands out shuffled page ids (never page 0, so padding reads are really masked)."""

    def __init__(self, num_pages: int, seed: int) -> None:
        self.free = list(range(1, num_pages))
        random.Random(seed).shuffle(self.free)

    def take(self, n: int) -> list[int]:
        out, self.free = self.free[:n], self.free[n:]
        return out


def pages_for(n_tokens: int) -> int:
    return -(-n_tokens // PAGE)


@dataclass
class MixedScenario:
    """Three sequences run as: prefill A; one mixed step (A decodes, B extends after A's first
    2 pages, C prefills); then ``decode_steps - 1`` steps where all three decode. The tokens fed
    after each prompt are the float64 oracle's greedy continuation, fixed up front, so every path
    runs the same tokens and the oracle's rows are computed once."""

    seqs: dict[str, list[int]]  # full sequences: prompt + fed continuation
    prompt_lens: dict[str, int]
    decode_steps: int
    shared: int = 2 * PAGE  # B's first tokens are A's, on A's pages

    @classmethod
    def build(cls, oracle: Oracle, vocab: int, decode_steps: int, seed: int = 0) -> MixedScenario:
        g = torch.Generator().manual_seed(seed)
        a = torch.randint(0, vocab, (45,), generator=g).tolist()  # not a page multiple
        b = a[: 2 * PAGE] + torch.randint(0, vocab, (19,), generator=g).tolist()
        c = torch.randint(0, vocab, (30,), generator=g).tolist()
        fed = {"A": decode_steps, "B": decode_steps - 1, "C": decode_steps - 1}
        seqs = {}
        for name, prompt in (("A", a), ("B", b), ("C", c)):
            seqs[name] = prompt + oracle.greedy(prompt, fed[name])
        return cls(seqs, {"A": len(a), "B": len(b), "C": len(c)}, decode_steps)

    def run(self, runner: ModelRunner, seed: int = 0) -> dict[str, torch.Tensor]:
        """Every step through ``runner``; the logit rows of each sequence, by position."""
        dealer = PageDealer(runner.num_pages, seed)
        cap = max(len(s) for s in self.seqs.values()) + 1
        pages = {name: dealer.take(pages_for(cap)) for name in ("A", "C")}
        pages["B"] = pages["A"][:2] + dealer.take(pages_for(cap) - 2)
        rows: dict[str, list[torch.Tensor]] = {"A": [], "B": [], "C": []}
        a_len = self.prompt_lens["A"]
        a0 = RequestSlice(self.seqs["A"][:a_len], 0, pages["A"])
        logits = runner.forward(runner.build_batch([a0]), True)
        rows["A"].extend(logits)
        pos = {"A": a_len, "B": self.shared, "C": 0}  # next position to feed
        order = ["B", "A", "C"]
        for _step in range(self.decode_steps):
            reqs = []
            for name in order:
                end = (
                    self.prompt_lens[name] if pos[name] < self.prompt_lens[name] else pos[name] + 1
                )
                ids = self.seqs[name][pos[name] : end]
                reqs.append(RequestSlice(ids, pos[name], pages[name]))
                pos[name] = end
            out = runner.forward(runner.build_batch(reqs))
            assert out.shape == (len(reqs), runner.vocab_size) and out.dtype == torch.float32
            for row, name in enumerate(order):
                rows[name].append(out[row])
        return {name: torch.stack(r) for name, r in rows.items()}

    def positions(self, name: str) -> list[int]:
        """The positions whose logits :meth:`run` returns for ``name``, in order."""
        if name == "A":
            return list(range(self.prompt_lens["A"] + self.decode_steps))
        return list(range(self.prompt_lens[name] - 1, len(self.seqs[name])))

    def judge(
        self, rows: dict[str, torch.Tensor], oracle: Oracle, contract: Contract, path: str
    ) -> int:
        """Every row within ``contract`` of the oracle, greedy tokens the oracle's unless tied;
        returns the number of decisive greedy rows."""
        decisive = 0
        for name, got in rows.items():
            at = self.positions(name)
            seq = self.seqs[name]
            truth = oracle.logits(seq)[at]
            # bf16's own rounding (2^-9) dwarfs summation-order luck: two forms suffice there
            prefill = self.prompt_lens[name] if contract.dtype == torch.float32 else None
            refs = [r[at] for r in oracle.references(seq, contract.dtype, prefill)]
            bound = check_rows(got, truth, refs, contract, path, f"request {name} logits")
            argmax = got.argmax(-1).tolist()
            decisive += check_greedy_tokens(argmax, truth, bound, f"{path} request {name}")
        return decisive


@pytest.fixture(scope="module")
def tiny_scenario(tiny_oracle):
    return MixedScenario.build(tiny_oracle, 256, decode_steps=6)


#: (contract, kernel path): every float32 path and every bf16 path this host executes.
CASES = [pytest.param(FP32, p, id=f"fp32-{p}") for p in fp32_paths()] + [
    pytest.param(BF16, p, id=f"bf16-{p}") for p in bf16_paths()
]


def run_and_judge(model, oracle, scenario, contract, path, monkeypatch, num_pages: int) -> None:
    """Run ``scenario`` on ``path`` in the contract's dtype and judge it against ``oracle``;
    float32 must have decisive greedy rows (bf16's wider bound may leave none on a random model)."""
    use_path(path, monkeypatch)
    runner = ModelRunner(model, num_pages=num_pages, page_size=PAGE, dtype=contract.dtype)
    assert_runs_path(runner.backend, path, runner.config.head_dim)
    decisive = scenario.judge(scenario.run(runner), oracle, contract, str(path))
    assert contract is not FP32 or decisive > 0


@pytest.mark.parametrize("contract, path", CASES)
def test_tiny_llama_matches_oracle_mixed_batch(
    tiny_llama, tiny_oracle, tiny_scenario, contract, path, monkeypatch
):
    run_and_judge(tiny_llama, tiny_oracle, tiny_scenario, contract, path, monkeypatch, 64)


@pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")
def test_oracle_onednn_form_computes_the_same_model(tiny_llama, tiny_oracle):
    """The oracle's oneDNN-GEMM reference form is the model itself, summed in another order: its
    logits sit as near the float64 oracle as transformers' float32 forward does (a transposed or
    dropped weight would put them orders of magnitude away)."""
    ids = list(range(5, 60))
    truth = tiny_oracle.logits(ids)
    sdpa = tiny_oracle.logits(ids, torch.float32, "sdpa")
    onednn = tiny_oracle.logits(ids, torch.float32, "sdpa-onednn")
    assert len(tiny_oracle.references(ids, torch.float32)) == 3
    ref_err = (sdpa - truth).abs().max().item()
    assert 0 < ref_err < 1e-4
    assert (onednn - truth).abs().max().item() < 8 * ref_err


def test_tiny_llama_config_and_state_dict_constructor(tiny_llama):
    runner = ModelRunner(
        tiny_llama.config, tiny_llama.state_dict(), num_pages=8, page_size=PAGE, dtype=torch.float32
    )
    ids = list(range(3, 40))
    logits = runner.forward(runner.build_batch([RequestSlice(ids, 0, [5, 2, 7])]))
    torch.testing.assert_close(logits[0], hf_last_logits(tiny_llama, ids), atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def real_scenario(real_oracle, real_model):
    return MixedScenario.build(real_oracle, real_model.config.vocab_size, decode_steps=16)


@pytest.mark.real_model
@pytest.mark.slow
@pytest.mark.parametrize("contract, path", CASES)
def test_smollm2_matches_oracle_mixed_batch(
    real_model, real_oracle, real_scenario, contract, path, monkeypatch
):
    run_and_judge(real_model, real_oracle, real_scenario, contract, path, monkeypatch, 40)


@pytest.mark.real_model
def test_smollm2_bf16_greedy_chat_answer(real_model):
    tok = real_model.tokenizer
    # The system line gives every greedy step a fp32 top-1 margin >= 1.5 logits: without it the
    # first token is a near tie ("The" vs "L", 0.08 apart) that any bf16 rounding may flip.
    ids = tok.apply_chat_template(
        [
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        add_generation_prompt=True,
        tokenize=True,
    )
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    runner = ModelRunner(real_model, num_pages=16, page_size=PAGE, dtype=torch.bfloat16)
    pages = list(range(15, 0, -1))
    out: list[int] = []
    req = RequestSlice(ids, 0, pages)
    for _ in range(12):
        tok_id = int(runner.forward(runner.build_batch([req]))[0].argmax())
        out.append(tok_id)
        if tok_id == 2:
            break
        req = RequestSlice([tok_id], len(ids) + len(out) - 1, pages)
    text = tok.decode(out)
    assert "Paris" in text, text


def _naive_paged_attention(q, k_cache, v_cache, pages, prefix, n, scale):
    """Per-request reference: gather slots, causal over the new rows, full over the prefix."""
    p, hkv, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    total = prefix + n
    slots = [pages[i // p] * p + i % p for i in range(total)]
    k = k_cache.view(-1, hkv, d)[slots].float()
    v = v_cache.view(-1, hkv, d)[slots].float()
    group = q.shape[1] // hkv
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = torch.einsum("thd,lhd->htl", q.float(), k) * scale
    allowed = torch.arange(total)[None, :] <= (prefix + torch.arange(n))[:, None]
    s = s.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("htl,lhd->thd", s.softmax(-1), v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_standalone_torch_attention_functions(dtype):
    g = torch.Generator().manual_seed(3)
    hq, hkv, d, num_pages = 6, 2, 32, 40
    k_cache = torch.randn(num_pages, PAGE, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_pages, PAGE, hkv, d, generator=g).to(dtype)
    prefix, ext = [0, 20, 33, 5], [17, 1, 9, 1]
    perm = torch.randperm(num_pages, generator=g).tolist()
    tables = [perm[i * 5 : (i + 1) * 5] for i in range(4)]
    page_table = torch.tensor(tables, dtype=torch.int32)
    starts = [0, 17, 18, 27]
    q = torch.randn(sum(ext), hq, d, generator=g).to(dtype)
    scale = d**-0.5
    # store then attend, like a layer would
    new_k = torch.randn(sum(ext), hkv, d, generator=g).to(dtype)
    new_v = torch.randn(sum(ext), hkv, d, generator=g).to(dtype)
    slots = []
    for t, p, n in zip(tables, prefix, ext):
        slots += [t[i // PAGE] * PAGE + i % PAGE for i in range(p, p + n)]
    torch_store_kvcache(new_k, new_v, k_cache, v_cache, torch.tensor(slots))
    assert torch.equal(k_cache.view(-1, hkv, d)[slots], new_k)
    out = torch_extend_attention(
        q,
        k_cache,
        v_cache,
        page_table,
        torch.tensor(prefix, dtype=torch.int32),
        torch.tensor(ext, dtype=torch.int32),
        torch.tensor(starts, dtype=torch.int32),
        scale,
    )
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for t, p, n, s in zip(tables, prefix, ext, starts):
        ref = _naive_paged_attention(q[s : s + n], k_cache, v_cache, t, p, n, scale)
        torch.testing.assert_close(out[s : s + n].float(), ref, atol=tol, rtol=tol)
    # decode: one query row per request over seq_lens tokens
    seq = [21, 1, 80, 6]
    qd = torch.randn(4, hq, d, generator=g).to(dtype)
    outd = torch_decode_attention(
        qd, k_cache, v_cache, page_table, torch.tensor(seq, dtype=torch.int32), scale
    )
    for i, t in enumerate(tables):
        ref = _naive_paged_attention(qd[i : i + 1], k_cache, v_cache, t, seq[i] - 1, 1, scale)
        torch.testing.assert_close(outd[i : i + 1].float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("native_on", ["1", "0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_pool_copy_pages_and_budget(monkeypatch, native_on, dtype):
    """Page copies in every layer's K and V (the native copy_pages_ on the CPU, the torch
    gather with RADIXKV_NATIVE=0), other pages untouched; the budget arithmetic."""
    monkeypatch.setenv("RADIXKV_NATIVE", native_on)
    pool = KVPool(num_layers=2, num_pages=6, page_size=4, num_kv_heads=2, head_dim=8, dtype=dtype)
    for c in pool.k + pool.v:
        c.copy_(torch.randn_like(c))
    before = [c.clone() for c in pool.k + pool.v]
    pool.copy_pages([1, 2], [4, 0])
    for c, b in zip(pool.k + pool.v, before):
        assert torch.equal(c[4], b[1]) and torch.equal(c[0], b[2])
        assert torch.equal(c[1], b[1]) and torch.equal(c[3], b[3]) and torch.equal(c[5], b[5])
    if dtype is torch.bfloat16:
        return
    assert pool.bytes_per_page == 2 * 2 * 4 * 2 * 8 * 4
    assert pool.k_flat(1).shape == (24, 2, 8)
    big = KVPool.from_memory_budget(10 * pool.bytes_per_page + 5, 2, 4, 2, 8)
    assert big.num_pages == 10
    with pytest.raises(ValueError):
        KVPool.from_memory_budget(10, 2, 4, 2, 8)
    module = native.load() if native_on == "1" else None
    if module is not None:
        with pytest.raises(RuntimeError, match="outside the cache"):
            module.copy_pages_(pool.k, torch.tensor([6]), torch.tensor([0]))


def test_triton_backend_same_greedy_tokens_as_torch(tiny_llama):
    """Runs the Triton kernels (on the GPU, or the interpreter on CPU) inside our model."""
    runners = {
        name: ModelRunner(
            tiny_llama,
            num_pages=24,
            page_size=PAGE,
            dtype=torch.float32,
            attention_backend=name,
            device=TRITON_DEVICE if name == "triton" else "cpu",
        )
        for name in ("torch", "triton")
    }
    g = torch.Generator().manual_seed(5)
    a = torch.randint(0, 256, (21,), generator=g).tolist()
    b = a[:16] + torch.randint(0, 256, (7,), generator=g).tolist()
    tokens: dict[str, list[list[int]]] = {}
    for name, runner in runners.items():
        a_pages, b_pages = [9, 4, 17, 2], [9, 11, 6, 20]
        seqs = [list(a), list(b)]
        out = runner.forward(runner.build_batch([RequestSlice(a, 0, a_pages)]))
        reqs = [
            RequestSlice([int(out[0].argmax())], len(a), a_pages),
            RequestSlice(b[16:], 16, b_pages),
        ]
        seqs[0].append(int(out[0].argmax()))
        for _ in range(5):
            out = runner.forward(runner.build_batch(reqs))
            reqs = []
            for i, pages in enumerate((a_pages, b_pages)):
                t = int(out[i].argmax())
                seqs[i].append(t)
                reqs.append(RequestSlice([t], len(seqs[i]) - 1, pages))
        tokens[name] = seqs
    assert tokens["triton"] == tokens["torch"]


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_triton_backend_over_quantized_pages_runs_the_model(tiny_llama, kv_cache_dtype):
    """Over int8 / fp8 pages the factory gives the Triton backend (GPU, or interpreter on CPU): the
    model runs a prompt and decode steps through it, its store writes the torch path's bytes, and
    the greedy tokens are the torch path's. (Logits are not compared closely: the torch paths
    attend a fresh prompt over its unquantized K/V, the Triton kernels over the stored rows; the
    backends themselves are compared in tests/test_kernels_quant.py.)"""
    from radixkv.model.attention.triton_backend import TritonAttentionBackend

    runners = {
        name: ModelRunner(
            tiny_llama,
            num_pages=12,
            page_size=PAGE,
            dtype=torch.float32,
            attention_backend=name,
            kv_cache_dtype=kv_cache_dtype,
            device=TRITON_DEVICE if name == "triton" else "cpu",
        )
        for name in ("torch", "triton")
    }
    triton_backend = runners["triton"].backend  # int8: inside the rotation
    assert isinstance(getattr(triton_backend, "inner", triton_backend), TritonAttentionBackend)
    assert runners["triton"].pool.quantized
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, 256, (19,), generator=g).tolist()
    pages = [5, 2]
    tokens: dict[str, list[int]] = {}
    for name, runner in runners.items():
        seq = list(prompt)
        out = runner.forward(runner.build_batch([RequestSlice(seq, 0, pages)]))
        for _ in range(4):
            assert torch.isfinite(out).all()
            seq.append(int(out[0].argmax()))
            out = runner.forward(runner.build_batch([RequestSlice(seq[-1:], len(seq) - 1, pages)]))
        tokens[name] = seq[len(prompt) :]
    assert tokens["triton"] == tokens["torch"]
    # layer 0's K/V come from the same embeddings: both stores wrote the same bytes (on a GPU
    # its matmuls round K/V differently from the CPU's, so there the values agree to one code)
    t_pool, r_pool = runners["triton"].pool, runners["torch"].pool
    for page in pages:
        for t_rows, r_rows in (
            (t_pool.k[0][page].cpu(), r_pool.k[0][page]),
            (t_pool.v[0][page].cpu(), r_pool.v[0][page]),
        ):
            if TRITON_DEVICE == "cpu":
                assert torch.equal(t_rows, r_rows)
            else:
                t_vals, r_vals = dequantize(t_rows), dequantize(r_rows)
                # one code: 1/127 of the row's absmax for int8, 32/448 at e4m3's top binade
                code = 1 / 127 if kv_cache_dtype == "int8" else 32 / 448
                tol = code * 1.01 * r_vals.abs().amax(-1, keepdim=True) + 1e-6
                assert ((t_vals - r_vals).abs() <= tol).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_huge_zeros_are_zeros_writable_and_outlive_their_names(dtype):
    """The KV pool's lazily committed buffers read as zeros, take writes, are independent of
    each other, and stay valid through views after the pool's own references are gone."""
    import gc

    from radixkv.model.hugepages import huge_zeros

    shape = (64, 16, 3, 64)  # 12 MiB in float32, 6 MiB in bf16: the mapped path
    a, b = huge_zeros(shape, dtype), huge_zeros(shape, dtype)
    assert a.shape == shape and a.dtype == dtype and a.is_contiguous()
    assert not a.any() and not b.any()
    a[3, 5] = 1.5
    assert a[3, 5].eq(1.5).all() and not b.any()
    view = a[3]
    del a
    gc.collect()
    assert view[5].eq(1.5).all() and view[4].eq(0).all()
    small = huge_zeros((2, 3), dtype)
    assert small.shape == (2, 3) and not small.any()


def _mapping_of(address: int) -> tuple[str, dict[str, int]]:
    """The permissions and the kB fields of this process's mapping holding ``address``."""
    perms, fields, inside = "", {}, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                if inside:
                    break
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                inside, perms = lo <= address < hi, head[1]
            elif inside and len(head) == 3 and head[2] == "kB":
                fields[head[0].rstrip(":")] = int(head[1])
    assert perms, f"no mapping holds {address:#x}"
    return perms, fields


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="THP is Linux's")
def test_huge_zeros_memory_is_private_and_gets_huge_pages():
    """The pool's memory is a *private* anonymous mapping: a shared one (``mmap.mmap(-1, n)``'s
    default) is shmem, whose THP follows ``shmem_enabled`` (``never`` by default), so its
    ``MADV_HUGEPAGE`` gave the KV pool no huge pages at all. Where THP is on (``madvise`` or
    ``always``), the written buffer holds some."""
    from pathlib import Path

    from radixkv.model.hugepages import huge_zeros

    t = huge_zeros((32 << 20,), torch.uint8)
    t.fill_(1)
    perms, fields = _mapping_of(t.data_ptr() + (16 << 20))
    assert perms.endswith("p"), f"the pool's mapping is {perms}, not private"
    assert fields.get("Rss", 0) >= 16 << 10, fields  # the written half is resident
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists() and "[never]" not in thp.read_text():
        assert fields.get("AnonHugePages", 0) > 0, fields

"""Quantized KV pages (``kv_cache_dtype`` int8 / fp8_e4m3, radixkv/model/kv_quant.py).

* the row format: codes within half a step of a float64 oracle, the scale inside the row, and
  a zero row stays zero;
* capacity: a page's bytes at the same geometry, against bfloat16 and float32;
* the engine: greedy tokens over quantized pages equal from a cold prompt and from the prefix
  cache, and through the host, disk and Redis tiers, which keep the rows as they are;
* fingerprints: pages of one KV format (or of one model dtype) never serve another;
* bad settings are a ``ValueError`` naming the alternative.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis_fixture
import torch
from test_tiers import _tiny, assert_idle_clean, cycle_workload, greedy, run_sequential

from radixkv import Engine
from radixkv.engine.assembly import engine_fingerprint
from radixkv.model.kv_pool import KVPool
from radixkv.model.kv_quant import SCALE_BYTES, dequantize, hadamard, quantize

P = 16
QUANT = ["int8", "fp8_e4m3"]
redis_server = redis_fixture.redis_server


@pytest.fixture(scope="module")
def tiny() -> Any:
    return _tiny(1234, "tiny-quant")


def engine(model: Any, kv: str, **knobs: Any) -> Engine:
    knobs.setdefault("page_size", P)
    knobs.setdefault("dtype", "float32")
    knobs.setdefault("kv_cache_tokens", 4096)
    return Engine(model, kv_cache_dtype=kv, **knobs)


# ------------------------------------------------------------------------------- row format
@pytest.mark.parametrize("storage", [torch.int8, torch.uint8], ids=["int8", "fp8_e4m3"])
def test_rows_round_trip_within_their_step(storage: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 64, generator=g, dtype=torch.float64) * 4
    x[5, 1] = 0.0  # an all-zero row
    x[7, 2, 9] = 900.0  # an outlier owns its row's scale, not its neighbours'
    rows = quantize(x.float(), storage)
    assert rows.shape == (64, 3, 64 + SCALE_BYTES) and rows.dtype == storage
    back = dequantize(rows, torch.float64)
    scale = rows[..., 64:].contiguous().view(torch.bfloat16).double()
    amax = x.abs().amax(-1, keepdim=True)
    qmax = 127 if storage == torch.int8 else 448
    assert (scale >= amax / qmax).all()  # no code overflows
    assert (scale <= amax / qmax * (1 + 2**-7)).all()  # each row's own: the outlier's is its own
    err = (back - x).abs()
    if storage == torch.int8:
        assert (err <= scale / 2 * (1 + 1e-6) + 1e-6 * amax).all()
    else:  # e4m3 keeps 3 mantissa bits: half a step is 2^-4 of the value (subnormals: absolute)
        assert (err <= (x.abs() * 2**-4).clamp_min(scale * 2**-9) * (1 + 1e-6)).all()
    assert back[5, 1].abs().max() == 0


def test_a_page_takes_fewer_bytes_scales_included() -> None:
    geometry = (30, P, 3, 64)  # SmolLM2-135M: 30 layers, 3 KV heads of 64
    bf16 = KVPool.bytes_per_page_for(*geometry, torch.bfloat16)
    fp32 = KVPool.bytes_per_page_for(*geometry, torch.float32)
    for storage in (torch.int8, torch.uint8):
        q = KVPool.bytes_per_page_for(*geometry, storage)
        assert q == 2 * 30 * P * 3 * (64 + 2)
        assert bf16 / q == pytest.approx(128 / 66) and fp32 / q == pytest.approx(256 / 66)


# ---------------------------------------------------------------------------------- engine
@pytest.mark.parametrize("kv", QUANT)
def test_engine_over_quantized_pages_is_cache_consistent(tiny: Any, kv: str) -> None:
    prompts = cycle_workload(rounds=2, seed=3)
    e = engine(tiny, kv)
    assert e.runner.pool.quantized and e.runner.pool.row_dim == e.runner.pool.head_dim + 2
    first = run_sequential(e, prompts)
    stats = e.stats()
    assert stats["cached_tokens_total"] > 0  # the second round hit the system prompts
    assert stats["kv_cache_dtype"] == kv
    assert stats["kv_bytes_per_token"] == 2 * 2 * 2 * (16 + 2)  # 2 layers, 2 KV heads of 16
    assert stats["kv_pool_bytes"] == e.runner.pool.total_bytes
    from radixkv.server.metrics import ServerMetrics

    metrics = ServerMetrics()
    metrics.update_from_stats(stats)
    assert "radixkv_kv_bytes_per_token 144.0" in metrics.render().decode()
    cold = engine(tiny, kv, enable_prefix_cache=False)
    assert run_sequential(cold, prompts) == first
    assert_idle_clean(e)


@pytest.mark.parametrize("kv", QUANT)
def test_host_and_disk_tiers_keep_quantized_rows(tiny: Any, kv: str, tmp_path: Path) -> None:
    prompts = cycle_workload(rounds=3, seed=5)
    want = run_sequential(engine(tiny, kv, kv_cache_tokens=16384), prompts)
    tiered = engine(
        tiny, kv, kv_cache_tokens=640, host_cache_tokens=4096, disk_cache_dir=str(tmp_path)
    )
    assert tiered.tiers.host.k.dtype == tiered.runner.pool.dtype
    assert run_sequential(tiered, prompts) == want
    by_tier = tiered.stats()["cached_tokens_by_tier"]
    assert by_tier.get("host", 0) > 0, by_tier
    tiered.close()  # makes what the host holds durable on disk
    fresh = engine(tiny, kv, kv_cache_tokens=640, disk_cache_dir=str(tmp_path))
    (out,) = fresh.generate([prompts[0]], greedy())
    assert out.cached_tokens_by_tier.get("disk", 0) > 0
    assert out.token_ids == want[0]
    assert fresh.stats()["tiers"]["corrupt_files"] == 0
    fresh.tiers.close()


def test_redis_serves_quantized_rows_to_another_replica(tiny: Any, redis_server: Any) -> None:
    redis_server.client().flushdb()
    ids = cycle_workload(rounds=1, seed=9)[0]
    (want,) = engine(tiny, "int8").generate([ids], greedy())
    a = engine(tiny, "int8", remote_cache_url=redis_server.url)
    b = engine(tiny, "int8", remote_cache_url=redis_server.url)
    a.generate([ids], greedy())
    a.tiers.sync()
    (out,) = b.generate([ids], greedy())
    assert out.cached_tokens_by_tier.get("remote", 0) >= len(ids) - 2 * P
    assert out.token_ids == want.token_ids
    assert b.stats()["tiers"]["remote"]["corrupt_values"] == 0
    # a replica with bf16-format... here float32 pages: a different fingerprint, so it misses
    c = engine(tiny, "auto", remote_cache_url=redis_server.url)
    (plain,) = c.generate([ids], greedy())
    assert plain.cached_tokens_by_tier.get("remote", 0) == 0
    for x in (a, b, c):
        x.tiers.close()


def test_fingerprint_names_the_kv_format_and_the_model_dtype(tiny: Any) -> None:
    prints = set()
    for kv in ("auto", "int8", "fp8_e4m3"):
        for dtype in ("float32", "bfloat16"):
            e = engine(tiny, kv, dtype=dtype, kv_cache_tokens=256)
            pool = e.runner.pool
            prints.add(
                engine_fingerprint(
                    "m", pool, P, compute_dtype=e.runner.dtype, config=e.runner.hf_config
                )
            )
    assert len(prints) == 6


# ------------------------------------------------------------------------------ bad settings
def test_bad_settings_name_the_alternative(tiny: Any) -> None:
    from radixkv import config
    from radixkv.model import kv_quant

    assert config.KV_CACHE_DTYPES == kv_quant.KV_CACHE_DTYPES  # the torch-free restatement
    with pytest.raises(ValueError, match="int8, fp8_e4m3"):
        engine(tiny, "int4")
    with pytest.raises(ValueError, match="kv_layout='paged'"):
        engine(tiny, "int8", kv_layout="virtual")


# --------------------------------------------------------------------------------- rotation
@pytest.mark.parametrize("d", [16, 64, 80, 96, 128])
def test_the_rotation_is_orthogonal_up_to_its_block(d: int) -> None:
    h = hadamard(d).double()
    b = d & -d
    assert set(h.unique().tolist()) <= {-1.0, 0.0, 1.0}
    assert torch.equal(h @ h.T, b * torch.eye(d, dtype=torch.float64))


def test_quantized_pages_are_rotated_and_unquantized_pages_are_not(
    tiny: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rotation runs where it was measured to help (int8's uniform grid; e4m3's perplexity
    on a long text) and nowhere else: the backend is wrapped for quantized pools only, and the
    fingerprint names the rotation, so rotated and unrotated pages of one dtype never serve
    each other."""
    from radixkv.engine import assembly
    from radixkv.model.attention.rotated_kv import RotatedKVBackend
    from radixkv.model.kv_quant import is_rotated

    wrapped = {}
    for kv in ("auto", "int8", "fp8_e4m3"):
        e = engine(tiny, kv, kv_cache_tokens=256)
        wrapped[kv] = isinstance(e.runner.backend, RotatedKVBackend)
        assert wrapped[kv] == is_rotated(e.runner.pool.dtype)
    assert wrapped == {"auto": False, "int8": True, "fp8_e4m3": True}
    pool, cfg, dtype = e.runner.pool, e.runner.hf_config, e.runner.dtype  # the fp8 engine's
    rotated = engine_fingerprint("m", pool, P, compute_dtype=dtype, config=cfg)
    monkeypatch.setattr(assembly, "is_rotated", lambda storage: False)
    assert engine_fingerprint("m", pool, P, compute_dtype=dtype, config=cfg) != rotated


def test_rotating_q_k_v_leaves_attention_unchanged(tiny: Any) -> None:
    """RotatedKVBackend around an unquantized float32 pool: the same logprobs as without it
    (the rotation alone, isolated from quantization)."""
    from radixkv import SamplingParams
    from radixkv.model.attention.rotated_kv import RotatedKVBackend

    prompts = cycle_workload(rounds=1, seed=2)[:2]
    params = SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=3
    )
    plain = engine(tiny, "auto", chunked_prefill_tokens=64)
    rotated = engine(tiny, "auto", chunked_prefill_tokens=64)
    rotated.runner.backend = RotatedKVBackend(rotated.runner.backend, plain.runner.pool.head_dim)
    worst = 0.0
    for a, b in zip(plain.generate(prompts, params), rotated.generate(prompts, params)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        pairs = list(zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]))
        pairs += list(zip(a.outputs[0].logprobs, b.outputs[0].logprobs))
        for x, y in pairs:
            assert x.keys() == y.keys()
            worst = max(worst, *(abs(x[t].logprob - y[t].logprob) for t in x))
    assert worst < 1e-4, worst


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_of_fused_qkv_heads_is_one_pass_with_the_same_values(dtype) -> None:
    """q, k, v that are consecutive heads of one buffer (the fused QKV projection's output) are
    rotated in one pass over the buffer; the wrapped backend gets the same values as from three
    separate passes, and the output is rotated back the same way. Three separately allocated
    tensors still take three passes."""
    from radixkv.model import native
    from radixkv.model.attention.base import AttentionBackend
    from radixkv.model.attention.rotated_kv import RotatedKVBackend, _fused_rows

    if native.load() is None:
        pytest.skip(f"no native build on this host: {native.build_error()}")
    seen: list[tuple[torch.Tensor, ...]] = []

    class Recording(AttentionBackend):
        def forward(self, q, k, v, k_cache, v_cache, meta, sm_scale):
            seen.append((q.clone(), k.clone(), v.clone(), torch.tensor(sm_scale)))
            return q.contiguous() * 2 + k.repeat_interleave(3, 1)

    t, hq, hkv, d = 5, 9, 3, 64
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=torch.Generator().manual_seed(0))
    qkv = qkv.to(dtype)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
    assert _fused_rows(q, k, v) is not None
    separate = (q.clone(), k.clone(), v.clone())
    assert _fused_rows(*separate) is None
    backend = RotatedKVBackend(Recording(), d)
    out_fused = backend.forward(q, k, v, None, None, None, 0.125)
    out_separate = backend.forward(*separate, None, None, None, 0.125)
    for a, b in zip(*seen):
        assert torch.equal(a, b)
    assert torch.equal(out_fused, out_separate)
    # and the values are the rotation: q H, with the softmax scale divided by the block
    h = hadamard(d).double()
    assert torch.allclose(seen[0][0].double(), q.double() @ h, rtol=2**-7, atol=1e-5)
    assert float(seen[0][3]) == pytest.approx(0.125 / 64)


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_scale_ablation_simulates_the_engine_and_keeps_one_scale_a_page(tiny: Any, kv) -> None:
    """bench/kv_scale_ablation.py, which chose per-token scales by measurement: per token, its
    float32 simulation gives the quantized engine's own greedy tokens and logprobs; per page,
    every (page, head) of the pool holds values on one grid (one scale, codes in range) after
    decodes that grew pages' scales and re-rounded their rows."""
    from bench.kv_scale_ablation import FakeQuantBackend, install
    from radixkv import SamplingParams
    from radixkv.model.kv_quant import is_rotated, kv_storage_dtype

    storage = kv_storage_dtype(kv, torch.float32)
    rotated = is_rotated(storage)  # as the engine stores them
    prompts = cycle_workload(rounds=1, seed=3)[:3]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    real = engine(tiny, kv, chunked_prefill_tokens=32)
    sim = engine(tiny, "auto", chunked_prefill_tokens=32)
    install(sim, storage, per_page=False, rotated=rotated)
    for a, b in zip(real.generate(prompts, params), sim.generate(prompts, params)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys()
            assert max(abs(x[t].logprob - y[t].logprob) for t in x) < 1e-4

    paged = engine(tiny, "auto", chunked_prefill_tokens=32)
    install(paged, storage, per_page=True, rotated=rotated)
    paged.generate(prompts, params)
    fake = paged.runner.backend.inner if rotated else paged.runner.backend
    assert isinstance(fake, FakeQuantBackend)
    pool = paged.runner.pool
    int8 = storage == torch.int8
    qmax = 127.0 if int8 else 448.0
    checked = 0
    for cache in (*pool.k, *pool.v):
        scales = fake.scales[cache.data_ptr()]
        for page in scales.abs().sum(1).nonzero().flatten().tolist():
            for h in range(pool.num_kv_heads):
                s, rows = float(scales[page, h]), cache[page, :, h].double()
                if s == 0:
                    continue
                written = rows.abs().amax(1) > 0  # rows never written stay zero
                codes = rows[written] / s
                assert float(codes.abs().max()) <= qmax
                if int8:  # integer codes
                    assert torch.equal(codes, codes.round())
                else:  # e4m3: representable values
                    c = codes.float()
                    assert torch.equal(c.to(torch.float8_e4m3fn).float(), c)
                checked += 1
    assert checked > 0
    assert fake.regrown > 0  # decodes grew scales over rows already stored (and re-rounded them)


# ------------------------------------------------------------------------------- simulator
def test_simulator_sizes_a_memory_budget_per_kv_dtype(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``radixkv simulate --kv-memory-gb`` (no torch there) counts a token's bytes as the pool
    does, and at a budget where bfloat16 evicts on the multi-turn workload, int8 pages hit more."""
    import json

    from radixkv.cli import main
    from radixkv.sim.capacity import ELEMENT_BYTES, kv_bytes_per_token
    from radixkv.sim.workloads import multi_turn, write_jsonl

    storage = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    storage.update(int8=torch.int8, fp8_e4m3=torch.uint8)
    assert set(storage) == set(ELEMENT_BYTES)
    for name, dtype in storage.items():
        for geometry in ((30, 3, 64), (32, 8, 128)):
            pool = KVPool.bytes_per_page_for(geometry[0], 1, geometry[1], geometry[2], dtype)
            assert kv_bytes_per_token(*geometry, name) == pool
    path = tmp_path / "mt.jsonl"
    write_jsonl(multi_turn(num_clients=16, num_rounds=4, seed=0), path)
    rates = {}
    for kv in ("bfloat16", "int8"):
        args = ["simulate", "--trace", str(path), "--page-size", "16", "--json"]
        assert main([*args, "--kv-memory-gb", "0.25", "--kv-cache-dtype", kv]) == 0
        out = json.loads(capsys.readouterr().out)
        rates[kv] = (out["token_hit_rate"], out["evictions"], out["optimal_hit_rate"])
    assert rates["bfloat16"][1] > 0 and rates["int8"][1] == 0
    assert rates["bfloat16"][0] < rates["int8"][0] == rates["int8"][2]
    assert main(["simulate", "--trace", str(path), "--kv-memory-gb", "1", "--geometry", "3,x"]) == 2


@pytest.mark.parametrize("kv", QUANT)
@pytest.mark.parametrize("mode", ["cascade", "plain"])
def test_a_prompt_gives_the_same_logprobs_cold_and_from_the_cache(
    tiny: Any, kv: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cold prompt attends over its stored (quantized) rows, as a later request that finds
    them cached does: the second request's logprobs equal the first's."""
    from radixkv import SamplingParams

    monkeypatch.setenv("RADIXKV_FP32_ATTENTION", mode)
    e = engine(tiny, kv)
    prompt = cycle_workload(rounds=1, seed=4)[0][:100]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=4)
    (cold,) = e.generate([prompt], params)
    (hit,) = e.generate([prompt], params)
    assert hit.cached_tokens > 0 and hit.outputs[0].token_ids == cold.outputs[0].token_ids
    worst = max(
        abs(a[t].logprob - b[t].logprob)
        for a, b in zip(cold.outputs[0].logprobs, hit.outputs[0].logprobs)
        for t in a
    )
    assert worst < 1e-4, worst

"""``quantization="int8"`` (radixkv/model/int8_linear.py): the layer against a float64 product of
its dequantized weight, and a tiny Llama served int8 against transformers' float64 forward of the
same model with its projections replaced by their dequantized values, so the only error judged
is the arithmetic's (quantization's own is in both)."""

from __future__ import annotations

import copy

import pytest
import torch
from architectures import tiny_model
from conftest import ByteTokenizer
from oracle import BF16, FP32, Oracle, check_greedy_tokens, check_rows

from radixkv import Engine, SamplingParams
from radixkv.config import EngineConfig
from radixkv.model.int8_linear import (
    INT8PACK_MAX_ROWS,
    Int8Linear,
    dequantize,
    int8_kernel_available,
    quantize_per_channel,
)
from radixkv.model.loader import LoadedModel
from radixkv.model.runner import ModelRunner, RequestSlice

#: transformers' names of the linears radixkv quantizes (the decoder layers' projections)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_quantized_codes_are_within_half_a_scale_of_the_weight():
    torch.manual_seed(0)
    w = torch.randn(40, 64) * torch.rand(40, 1) * 4
    w[3] = 0.0  # a zero row: scale 1, codes 0
    q, s = quantize_per_channel(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127 and s.shape == (40,)
    err = (dequantize(q, s, torch.float64) - w.double()).abs()
    assert (err <= s.double()[:, None] / 2 * (1 + 1e-6)).all()
    assert (q.abs().amax(1)[torch.arange(40) != 3] == 127).all()  # each row uses its range
    assert (q[3] == 0).all() and s[3] == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features", [96, 136, 7])
@pytest.mark.parametrize(
    "shape", [(1,), (3,), (2, 4), (5, 3)], ids=["1row", "3rows", "8rows", "15rows"]
)
@pytest.mark.parametrize("kernel", ["native", "aten"])
def test_int8_linear_matches_a_float64_product_of_the_dequantized_weight(
    dtype, in_features, shape, kernel
):
    """Every path: radixkv's native kernel up to ``native_rows`` rows (8), ATen's without it up to
    INT8PACK_MAX_ROWS rows (where ``in_features % 8 == 0``), the dequantized weight above and
    elsewhere. The error bound is the dtype's: float32 accumulation over K terms,
    ``K * eps * sum|x w|`` (a generous forward-error bound, not a host's rounding); bf16 adds the
    output's rounding, 2^-7 of the magnitudes summed. In float32 the result must also be far
    nearer than quantization's own error, so a layer running on the float weight instead would
    fail."""
    torch.manual_seed(1)
    linear = torch.nn.Linear(in_features, 48, bias=True).to(dtype)
    with torch.no_grad():
        linear.bias.normal_()
    layer = Int8Linear(linear)
    aten = int8_kernel_available() and in_features % 8 == 0
    if kernel == "native":
        if layer.native_rows == 0:
            pytest.skip("no native build here")
        assert layer.kernel == "native" and layer.native_rows == 8
    else:  # as without the native build
        layer.native_rows = 0
        layer.kernel = "aten" if aten else "dequantize"
    assert not hasattr(layer, "weight") and layer.qweight.dtype == torch.int8
    assert INT8PACK_MAX_ROWS == 3  # the shapes straddle it
    x = torch.randn(*shape, in_features).to(dtype)
    got = layer(x)
    assert got.shape == (*shape, 48) and got.dtype == dtype
    w64 = dequantize(layer.qweight, layer.scales, torch.float64)
    truth = x.double() @ w64.T + linear.bias.double()
    scale = x.double().abs() @ w64.abs().T + linear.bias.double().abs()
    eps = torch.finfo(torch.float32).eps
    bound = in_features * eps * scale
    if dtype == torch.bfloat16:  # the output's (and the fallback's weight's) rounding
        bound = bound + 2.0**-7 * scale
    assert ((got.double() - truth).abs() <= bound).all()
    if dtype == torch.float32:
        float_w = x.double() @ linear.weight.double().T + linear.bias.double()
        assert (float_w - truth).abs().max() > 100 * (got.double() - truth).abs().max()


def dequantized_model(
    model: torch.nn.Module, weight_dtype: torch.dtype = torch.float32
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``model``'s float32 and float64 copies whose projections hold their int8 values ``q * s``
    (float64: exactly; float32: rounded, for the oracle's reference forms), quantized from the
    weights in ``weight_dtype`` as radixkv's model in that dtype quantizes them."""
    copies = []
    for dtype in (torch.float32, torch.float64):
        twin = copy.deepcopy(model).to(dtype).eval()
        with torch.no_grad():
            for name, module in twin.named_modules():
                if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in PROJECTIONS:
                    source = model.get_submodule(name).weight.to(weight_dtype)
                    module.weight.copy_(dequantize(*quantize_per_channel(source), dtype))
        copies.append(twin)
    return copies[0], copies[1]


def int8_oracle(model: torch.nn.Module, weight_dtype: torch.dtype) -> Oracle:
    hf32, hf64 = dequantized_model(model, weight_dtype)
    oracle = Oracle(hf32)
    oracle._copies[(torch.float64, "sdpa")] = hf64  # the exact q * s, not hf32's rounding
    return oracle


@pytest.fixture(scope="module")
def int8_llama():
    model = tiny_model("llama3")
    return model, int8_oracle(model, torch.float32)


def test_int8_llama_logits_match_the_float64_oracle_of_its_dequantized_weights(int8_llama):
    model, oracle = int8_llama
    runner = ModelRunner(model, num_pages=8, page_size=16, dtype=torch.float32, quantization="int8")
    layer = runner.model.layers[0]
    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        proj = getattr(layer, name)
        assert isinstance(proj, Int8Linear), name
        # only the codes (1 byte a weight) and the scales are held, no float copy
        held = [*proj.parameters(), *proj.buffers()]
        assert sum(t.numel() * t.element_size() for t in held if t.dim() == 2) == (
            proj.in_features * proj.out_features
        ), name
    assert not isinstance(runner.model.lm_head, Int8Linear)  # the head stays in float32
    torch.manual_seed(3)
    ids = torch.randint(3, 259, (40,)).tolist()
    got = runner.forward(runner.build_batch([RequestSlice(ids, 0, [0, 1, 2])]), True)
    truth = oracle.logits(ids)
    check_rows(got, truth, oracle.references(ids, torch.float32), FP32, "int8 weights")
    # the check has teeth: the unquantized model's logits are far outside the bound
    plain = Oracle(model).logits(ids)
    assert (plain - truth).abs().amax(-1).min() > 1e-2


def test_bf16_int8_llama_logits_match_the_float64_oracle_of_its_dequantized_weights(int8_llama):
    """The bf16 model: codes and scales from the bf16 weights, bf16 activations, judged by the
    bf16 contract (transformers-bf16 of the same dequantized model as the reference). bf16's
    own rounding is as large as int8's on this model (the unquantized bf16 model lands at
    0.4-0.9 of this bound), so this catches a broken bf16 kernel or scale (orders of magnitude
    off), not int8 against float weights; the float32 test does that."""
    model, _ = int8_llama
    oracle = int8_oracle(model, torch.bfloat16)
    runner = ModelRunner(
        model, num_pages=8, page_size=16, dtype=torch.bfloat16, quantization="int8"
    )
    assert runner.model.layers[0].qkv_proj.scales.dtype == torch.bfloat16
    torch.manual_seed(4)
    ids = torch.randint(3, 259, (40,)).tolist()
    pages = [0, 1, 2]
    got = runner.forward(runner.build_batch([RequestSlice(ids, 0, pages)]), True)
    check_rows(got, oracle.logits(ids), oracle.references(ids, torch.bfloat16), BF16, "int8 bf16")
    # one decode row (ATen's kernel, not the dequantized weight)
    nxt = int(got[-1].argmax())
    step = runner.forward(runner.build_batch([RequestSlice([nxt], len(ids), pages)]))
    seq = [*ids, nxt]
    truth, refs = oracle.last_rows([seq], torch.bfloat16)
    check_rows(step, truth, refs, BF16, "int8 bf16 decode")


def test_int8_engine_greedy_tokens_are_the_oracle_s(int8_llama):
    model, oracle = int8_llama
    loaded = LoadedModel(model, ByteTokenizer(), model.config, "tiny-llama3")
    engine = Engine(loaded, page_size=16, dtype="float32", quantization="int8")
    prompt = list(b"int8 weights, one scale per channel")
    n = 12
    (out,) = engine.generate(
        [prompt], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    )
    tokens = list(out.outputs[0].token_ids)
    assert len(tokens) == n
    ids = prompt + tokens
    at = slice(len(prompt) - 1, len(ids) - 1)
    truth, bound, _ = oracle.judged(ids, at, FP32, prefill=len(prompt))
    assert check_greedy_tokens(tokens, truth, bound, "int8 engine greedy") > n // 2


@pytest.mark.parametrize("value", ["fp8", "awq", "INT8", "int4"])
def test_a_quantization_radixkv_lacks_is_refused_naming_the_choices(value):
    with pytest.raises(ValueError, match=rf"quantization={value!r}.*int8"):
        EngineConfig(quantization=value).validate()


@pytest.mark.parametrize("flag", ["--quantization", "-q"])
def test_the_quantization_flag_reaches_the_engine_and_refuses_vllm_s_other_methods(flag, capsys):
    """``--quantization int8`` (radixkv's flag, vLLM's spelling and its ``-q``) sets the knob;
    vLLM's other methods exit 2 at parsing, naming the value and the choice."""
    from test_serve_flags import parse

    from radixkv.server.engine_flags import engine_kwargs

    assert engine_kwargs(parse(flag, "int8"))["quantization"] == "int8"
    assert "quantization" not in engine_kwargs(parse())
    with pytest.raises(SystemExit) as exc:
        parse(flag, "awq")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'awq'" in err and "int8" in err, err


def test_an_int8_engine_never_reads_the_unquantized_engine_s_disk_pages(int8_llama, tmp_path):
    """The int8 model computes other K/V than the checkpoint's: its offload tiers are keyed by
    another fingerprint (a second unquantized engine does hit the pages, so the miss is the
    fingerprint's)."""
    model, _ = int8_llama
    loaded = LoadedModel(model, ByteTokenizer(), model.config, "tiny-llama3")
    prompt = list(b"a prompt long enough to fill a few pages of the disk tier, once")
    params = SamplingParams(max_tokens=1, temperature=0.0)
    hits = {}
    for name, quant in (("writer", None), ("int8", "int8"), ("plain", None)):
        e = Engine(
            loaded, page_size=16, dtype="float32", quantization=quant, disk_cache_dir=str(tmp_path)
        )
        (out,) = e.generate([prompt], params)
        hits[name] = out.cached_tokens_by_tier.get("disk", 0)
        e.close()  # every cached page written to the disk
    assert hits["writer"] == 0 and hits["int8"] == 0
    assert hits["plain"] >= 48, hits


def test_the_native_int8_kernel_refuses_what_it_does_not_compute():
    """Shapes that do not match, too many rows, or a weight that is not int8 raise a message
    naming the problem (the layer never sends those; a direct caller learns what to fix)."""
    from radixkv.model import native

    module = native.load()
    if module is None or not hasattr(module, "int8_linear_rows"):
        pytest.skip("no native build here")
    q, s = quantize_per_channel(torch.randn(16, 32))
    with pytest.raises(RuntimeError, match="do not match"):
        module.int8_linear_rows(torch.randn(1, 31), q, s)
    with pytest.raises(RuntimeError, match="1 to 8 rows"):
        module.int8_linear_rows(torch.randn(9, 32), q, s)
    with pytest.raises(RuntimeError, match="contiguous int8"):
        module.int8_linear_rows(torch.randn(1, 32), q.float(), s)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        module.int8_linear_rows(torch.randn(1, 32).double(), q, s)

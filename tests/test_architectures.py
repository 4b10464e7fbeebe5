"""Every architecture radixkv serves, judged against transformers' float64 forward of the same
weights: prefill, decodes, a cache hit mid-prompt, an extend after a cached prefix and a batch
that mixes them (tests/test_model.py's MixedScenario), on every kernel path this host runs, in
float32 and bf16; and a config radixkv cannot serve is refused by the name of what it lacks."""

from __future__ import annotations

import pytest
import torch
from architectures import CONFIGS, LLAMA3_ROPE, MOE, WINDOW, tiny_model
from kernel_paths import bf16_paths, fp32_paths
from oracle import BF16, FP32, Oracle
from test_model import MixedScenario, run_and_judge

from radixkv.model.arch import UnsupportedModelError, read_config
from radixkv.model.runner import ModelRunner

CASES = [pytest.param(FP32, p, id=f"fp32-{p}") for p in fp32_paths()] + [
    pytest.param(BF16, p, id=f"bf16-{p}") for p in bf16_paths()
]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def arch(request):
    model = tiny_model(request.param)
    oracle = Oracle(model)
    scenario = MixedScenario.build(oracle, 256, decode_steps=4)
    return request.param, model, oracle, scenario


@pytest.mark.parametrize("contract, path", CASES)
def test_architecture_matches_the_float64_oracle(arch, contract, path, monkeypatch):
    name, model, oracle, scenario = arch
    run_and_judge(model, oracle, scenario, contract, path, monkeypatch, 64)


def test_the_window_binds_in_the_scenario(arch):
    """The windowed architectures' prompts are longer than their window, so the window is
    exercised (and a wrong mask would be seen), and the config reads it on the right layers."""
    name, model, _, scenario = arch
    config = read_config(model.config)
    if name in ("mistral", "phi3", "mixtral"):
        assert config.layer_windows == [WINDOW] * config.num_layers
    elif name == "gemma3":
        assert config.layer_windows == [WINDOW, None, WINDOW, None]
        assert config.layer_rope == ["local", "global", "local", "global"]
    else:
        assert not config.has_windows
    assert max(len(s) for s in scenario.seqs.values()) > 2 * WINDOW


def test_every_feature_is_read(arch):
    name, model, _, _ = arch
    c = read_config(model.config)
    expect = {
        "qwen3": dict(qk_norm="head", attention_bias=True, o_bias=True),
        "gemma3": dict(
            qk_norm="head",
            norm_layout="sandwich",
            hidden_act="gelu_tanh",
            final_logit_softcap=4.0,
            attention_scale=60**-0.5,
            head_dim=256,
        ),
        "olmo2": dict(qk_norm="proj", norm_layout="post"),
        "granite": dict(
            embedding_scale=3.0,
            attention_scale=0.09,
            residual_multiplier=0.5,
            logits_divisor=2.5,
            mlp_bias=True,
            o_bias=True,
        ),
        "phi3": dict(rotary_dim=60, head_dim=80),
        "smollm3": dict(layer_rope=["global", "none", "global"]),
        "qwen2": dict(attention_bias=True, o_bias=False),
        "llama3": dict(rope_scaling=LLAMA3_ROPE),
        "qwen3_moe": dict(
            qk_norm="head",
            attention_bias=True,
            num_experts=6,
            num_experts_per_tok=2,
            expert_intermediate_size=36,
            norm_topk_prob=False,
            layer_experts=[True, False, True],
        ),
        "mixtral": dict(
            num_experts=5,
            num_experts_per_tok=2,
            expert_intermediate_size=136,
            norm_topk_prob=True,
            layer_experts=[True, True, True],
        ),
    }.get(name, {})
    for field, value in expect.items():
        assert getattr(c, field) == value, (name, field)


@pytest.mark.parametrize(
    "name, change, named",
    [
        ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        (
            "llama3",
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}},
            "yarn",
        ),
        ("qwen2", {"hidden_act": "relu"}, "hidden_act"),
        ("mistral", {"model_type": "mamba"}, "mamba"),
        ("qwen3", {"quantization_config": {"quant_method": "awq"}}, "quantization_config"),
        ("llama3", {"num_local_experts": 8}, "num_local_experts"),
        ("qwen3_moe", {"model_type": "qwen2_moe"}, "qwen2_moe"),
        ("qwen3_moe", {"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size"),
        ("mixtral", {"num_experts_per_tok": 6}, "num_experts_per_tok"),
    ],
)
def test_an_unsupported_config_is_refused_by_name(name, change, named):
    config = CONFIGS[name]()
    for key, value in change.items():
        setattr(config, key, value)
    with pytest.raises(UnsupportedModelError, match=named):
        read_config(config)


@pytest.mark.parametrize("name", MOE)
def test_routing_has_no_near_tie_in_the_scenario(name):
    """The MoE models' experts are chosen with a margin no valid float32 or bf16 computation can
    cross (tests/architectures.py's ``route_by_token``): on every token of the scenario, every
    sparse layer's gap between the 2nd and 3rd router logit of the float64 oracle is over 4x
    the largest error transformers' bf16 forward makes in those logits. So radixkv chooses the
    oracle's experts on every path, and a wrong dispatch cannot hide behind a routing tie."""
    model = tiny_model(name)
    oracle = Oracle(model)
    scenario = MixedScenario.build(oracle, 256, decode_steps=4)  # the arch fixture's
    routers = [n for n, m in model.named_modules() if n.endswith("mlp.gate")]
    assert len(routers) == sum(read_config(model.config).layer_experts or ())
    logits: dict[torch.dtype, list[torch.Tensor]] = {}
    for dtype in (torch.float64, torch.bfloat16):
        copy = oracle.model(dtype)
        seen: list[torch.Tensor] = []
        hooks = [
            copy.get_submodule(n).register_forward_hook(
                lambda _m, _i, out, seen=seen: seen.append(out[0].double())
            )
            for n in routers
        ]
        try:
            with torch.inference_mode():
                for seq in scenario.seqs.values():
                    copy(torch.tensor([seq]))
        finally:
            for hook in hooks:
                hook.remove()
        logits[dtype] = seen
    k = model.config.num_experts_per_tok
    margin = min(
        (lg.sort(-1, descending=True).values[:, k - 1 : k + 1].diff(dim=-1).abs().min().item())
        for lg in logits[torch.float64]
    )
    bf16_err = max((a - b).abs().max().item() for a, b in zip(*logits.values(), strict=True))
    assert margin > 4 * bf16_err, (name, margin, bf16_err)


def test_a_weight_nobody_reads_is_refused_by_name():
    """A checkpoint with a tensor the architecture module does not take (a feature it does not
    know) is refused at load, naming the tensor, instead of running without it."""
    model = tiny_model("llama3")
    sd = dict(model.state_dict())
    sd["model.layers.0.self_attn.q_norm.weight"] = torch.ones(32)
    with pytest.raises(UnsupportedModelError, match="layers.0.self_attn.q_norm.weight"):
        ModelRunner(model.config, sd, num_pages=8, page_size=16, dtype=torch.float32)
    # and the Qwen3 weights read as Llama are refused the same way, not served without q_norm
    qwen3 = tiny_model("qwen3")
    qwen3.config.model_type = "llama"
    with pytest.raises(UnsupportedModelError, match=r"self_attn\.[qk]_norm"):
        ModelRunner(qwen3, num_pages=8, page_size=16, dtype=torch.float32)


def test_windows_refuse_the_layouts_that_cannot_attend_them():
    model = tiny_model("mistral")
    with pytest.raises(ValueError, match="kv_layout='paged'"):
        ModelRunner(model, num_pages=8, page_size=16, kv_cache_dtype="int8")


def test_radixkv_info_says_what_it_will_run_and_refuses_by_name(tmp_path, capsys):
    from radixkv.cli import main

    CONFIGS["gemma3"]().save_pretrained(tmp_path / "gemma3")
    assert main(["info", str(tmp_path / "gemma3"), "--json"]) == 0
    info = __import__("json").loads(capsys.readouterr().out)
    assert info["architecture"] == "gemma3_text" and info["head dim"] == 256
    assert info["sliding window"].startswith(f"{WINDOW} tokens on 2 of 4 layers")
    assert "sandwich norms" in info["features"] and "gelu_tanh" in info["features"]
    assert info["isa"]  # and the host's kernel path for that head dim
    CONFIGS["qwen3_moe"]().save_pretrained(tmp_path / "qwen3_moe")
    assert main(["info", str(tmp_path / "qwen3_moe"), "--json"]) == 0
    info = __import__("json").loads(capsys.readouterr().out)
    assert info["architecture"] == "qwen3_moe"
    assert "6 experts of width 36, top 2, on 2 of 3 layers" in info["features"]
    bad = CONFIGS["gemma3"]()
    bad.attn_logit_softcapping = 50.0
    bad.save_pretrained(tmp_path / "bad")
    assert main(["info", str(tmp_path / "bad")]) == 2
    assert "attn_logit_softcapping" in capsys.readouterr().err

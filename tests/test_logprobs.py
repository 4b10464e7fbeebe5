"""Top-K logprobs of generated and prompt tokens against transformers' fp32 logits (1e-3)."""

from __future__ import annotations

import pytest
import torch

from radixkv import Engine, SamplingParams

pytestmark = pytest.mark.real_model

SYSTEM = "You are a concise assistant. Answer in one short sentence."


def hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' fp32 logits at every position of ``ids``."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def assert_top_matches(top, ref_row: torch.Tensor, tokenizer) -> None:
    vals, ids = ref_row.topk(len(top))
    assert [t.logprob for t in top] == pytest.approx(vals.tolist(), abs=1e-3)
    for t, want_id, want in zip(top, ids.tolist(), vals.tolist()):
        # equal ids, unless two candidates are tied within the tolerance
        assert t.token_id == want_id or abs(ref_row[t.token_id].item() - want) <= 1e-3
        assert t.decoded_token == tokenizer.decode([t.token_id])
    assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)


@pytest.fixture(scope="module")
def engine(real_model) -> Engine:
    return Engine(
        real_model, page_size=16, dtype="float32", kv_cache_tokens=4096, chunked_prefill_tokens=12
    )


@pytest.mark.parametrize(
    "knobs",
    [dict(temperature=0.0), dict(temperature=0.8, seed=3, repetition_penalty=1.3, top_k=20)],
    ids=["greedy", "sampled-penalised"],
)
def test_top_logprobs_equal_transformers(real_model, engine, knobs):
    prompt = engine.tokenize("The capital of France is")
    params = SamplingParams(max_tokens=6, logprobs=5, ignore_eos=True, **knobs)
    (out,) = engine.generate([prompt], params)
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.top_logprobs) == len(c.token_ids) == 6
    # raw logprobs: before temperature and penalties, whatever the sampler did with them
    ref = hf_logprobs(real_model.hf_model, prompt + c.token_ids[:-1])[len(prompt) - 1 :]
    for i, tok in enumerate(c.token_ids):
        assert c.logprobs[i] == pytest.approx(ref[i, tok].item(), abs=1e-3)
        assert len(c.top_logprobs[i]) == 5
        assert_top_matches(c.top_logprobs[i], ref[i], engine.tokenizer)
    engine.check_integrity()


def test_prompt_logprobs_compute_the_whole_prompt(real_model, engine):
    prompt = engine.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is Rome?"}]
    )
    assert len(prompt) > 2 * 12  # several prefill chunks
    greedy = SamplingParams(max_tokens=2, temperature=0.0)
    (warm,) = engine.generate([prompt], greedy)
    (hit,) = engine.generate([prompt], greedy)
    assert hit.cached_tokens > 0
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3, logprobs=0)
    (out,) = engine.generate([prompt], params)
    # a prompt-logprobs request does not read the cache: every position is computed
    assert out.cached_tokens == 0
    assert out.token_ids == warm.token_ids
    assert out.outputs[0].top_logprobs == [[], []]  # logprobs=0: the chosen token's only
    lps, tops = out.prompt_logprobs, out.prompt_top_logprobs
    assert len(lps) == len(tops) == len(prompt)
    assert lps[0] is None and tops[0] is None
    ref = hf_logprobs(real_model.hf_model, prompt)
    for i in range(1, len(prompt)):
        assert lps[i] == pytest.approx(ref[i - 1, prompt[i]].item(), abs=1e-3), i
        assert_top_matches(tops[i], ref[i - 1], engine.tokenizer)
    # its pages were still published: the next plain request hits the cache again
    (after,) = engine.generate([prompt], greedy)
    assert after.cached_tokens == hit.cached_tokens
    engine.check_integrity()

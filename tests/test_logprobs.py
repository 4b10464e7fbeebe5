"""Top-K logprobs of generated and prompt tokens against the float64 oracle's log_softmax, within
the float32 precision contract (tests/oracle.py) row by row."""

from __future__ import annotations

import pytest
import torch
from oracle import FP32, Oracle

from radixkv import Engine, SamplingParams

pytestmark = pytest.mark.real_model

SYSTEM = "You are a concise assistant. Answer in one short sentence."


def assert_logprobs(got, ref_row: torch.Tensor, bound: float, tokenizer) -> None:
    """Each listed logprob within ``bound`` of the oracle's; the listed ids are the oracle's
    top ids in order, unless two candidates are within ``2 * bound`` (a tie float32 may flip)."""
    vals, ids = ref_row.topk(len(got))
    for t, want_id, want in zip(got, ids.tolist(), vals.tolist()):
        assert abs(t.logprob - ref_row[t.token_id].item()) <= bound, (t, ref_row[t.token_id])
        assert t.token_id == want_id or abs(ref_row[t.token_id].item() - want) <= 2 * bound
        assert t.decoded_token == tokenizer.decode([t.token_id])
    assert [t.logprob for t in got] == sorted((t.logprob for t in got), reverse=True)


def judged_logprobs(oracle: Oracle, ids: list[int], at: slice, prefill: int | None):
    """The oracle's log_softmax rows at ``at`` and the float32 contract's bound per row."""
    truth, bound, _ = oracle.judged(ids, at, FP32, prefill=prefill, logprobs=True)
    return truth, bound.tolist()


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
def test_top_logprobs_equal_transformers(real_oracle, engine, knobs):
    prompt = engine.tokenize("The capital of France is")
    params = SamplingParams(max_tokens=6, logprobs=5, ignore_eos=True, **knobs)
    (out,) = engine.generate([prompt], params)
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.top_logprobs) == len(c.token_ids) == 6
    # raw logprobs: before temperature and penalties, whatever the sampler did with them
    seq = prompt + c.token_ids[:-1]
    ref, bound = judged_logprobs(real_oracle, seq, slice(len(prompt) - 1, None), len(prompt))
    for i, tok in enumerate(c.token_ids):
        assert abs(c.logprobs[i] - ref[i, tok].item()) <= bound[i], (i, c.logprobs[i], bound[i])
        assert len(c.top_logprobs[i]) == 5
        if knobs["temperature"] == 0.0:  # greedy: the chosen token is the engine's own top
            assert c.top_logprobs[i][0].token_id == tok
        assert_logprobs(c.top_logprobs[i], ref[i], bound[i], engine.tokenizer)
    engine.check_integrity()


def test_prompt_logprobs_compute_the_whole_prompt(real_oracle, engine):
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
    ref, bound = judged_logprobs(real_oracle, prompt, slice(None), None)
    for i in range(1, len(prompt)):
        assert abs(lps[i] - ref[i - 1, prompt[i]].item()) <= bound[i - 1], (i, lps[i])
        assert len(tops[i]) == 3
        assert_logprobs(tops[i], ref[i - 1], bound[i - 1], engine.tokenizer)
    # its pages were still published: the next plain request hits the cache again
    (after,) = engine.generate([prompt], greedy)
    assert after.cached_tokens == hit.cached_tokens
    engine.check_integrity()

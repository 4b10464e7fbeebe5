"""Logprobs and beam search over HTTP on SmolLM2 (fp32), read with the openai client and httpx.

* chat ``logprobs``/``top_logprobs`` and completions ``logprobs`` carry the full top-K, equal
  to the offline engine's; completions ``prompt_logprobs`` (vLLM's extra) too;
* ``/generate``: ``return_logprob``/``top_logprobs_num``/``logprob_start_len`` in SGLang's shapes;
* beam search through completions (``use_beam_search`` + ``best_of``) and ``/generate`` returns
  the offline engine's beams; bad values are 400s naming the field.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from fake_engine import ServerThread

from radixkv.server.app import create_app

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def engine(real_model: Any) -> Any:
    from radixkv import Engine

    return Engine(real_model, dtype="float32", kv_cache_tokens=4096)


@pytest.fixture(scope="module")
def server(engine: Any) -> Iterator[ServerThread]:
    with ServerThread(create_app(engine)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)


def offline(server: ServerThread, prompt: Any, **params: Any) -> Any:
    """The same request through the offline API, on the server's engine thread."""
    from radixkv import SamplingParams

    loop = server.app.state.engine_loop
    return loop.call_sync(lambda e: e.generate([prompt], SamplingParams(**params)), 300)[0]


def test_chat_top_logprobs(client: openai.OpenAI, server: ServerThread, engine: Any) -> None:
    name = str(server.app.state.model_name)
    messages = [{"role": "user", "content": "Name a large river in Europe."}]
    out = client.chat.completions.create(
        model=name, messages=messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    want = offline(
        server, engine.apply_chat_template(messages), max_tokens=4, temperature=0.0, logprobs=3
    ).outputs[0]
    for entry, tok, pos in zip(content, want.token_ids, want.logprobs):
        top = sorted(pos.values(), key=lambda lp: lp.rank)[:3]  # the offline top-3, by rank
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(pos[tok].logprob, abs=1e-4)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            [t.logprob for t in top], abs=1e-4
        )
        assert [t.token for t in entry.top_logprobs] == [t.decoded_token for t in top]
        # greedy: the chosen token is the most likely one
        assert entry.token == entry.top_logprobs[0].token
        assert entry.top_logprobs[0].bytes == list(entry.token.encode("utf-8"))


def test_completion_top_and_prompt_logprobs(client: openai.OpenAI, server: ServerThread) -> None:
    name = str(server.app.state.model_name)
    out = client.completions.create(
        model=name,
        prompt=PROMPT,
        max_tokens=3,
        temperature=0,
        logprobs=2,
        extra_body={"prompt_logprobs": 1},
    )
    lp = out.choices[0].logprobs
    assert lp is not None and lp.top_logprobs is not None and lp.token_logprobs is not None
    assert [len(t) for t in lp.top_logprobs] == [2, 2, 2]
    for chosen, tok, top in zip(lp.token_logprobs, lp.tokens or [], lp.top_logprobs):
        assert top[tok] == pytest.approx(chosen, abs=1e-6)  # greedy: chosen is in the top-2
    prompt_lps = (out.choices[0].model_extra or {})["prompt_logprobs"]
    ids = server.app.state.engine.tokenize(PROMPT)
    assert len(prompt_lps) == len(ids) and prompt_lps[0] is None
    want = offline(server, PROMPT, max_tokens=1, temperature=0.0, prompt_logprobs=1)
    for i in range(1, len(ids)):
        assert prompt_lps[i][str(ids[i])]["logprob"] == pytest.approx(
            want.prompt_logprobs[i][ids[i]].logprob, abs=1e-4
        )
        assert any(e["rank"] == 1 for e in prompt_lps[i].values())


def test_echo_with_logprobs_scores_the_prompt_as_vllm_does(
    client: openai.OpenAI, server: ServerThread
) -> None:
    """What evaluation harnesses send (issue 58): ``echo: true, logprobs: k`` with ``max_tokens``
    0 (the prompt alone) or more. The choice's logprobs cover the prompt's tokens (the first
    ``null``, as vLLM gives it), each the engine's prompt logprob (checked against transformers'
    float64 forward in tests/test_engine.py), then the output's."""
    name = str(server.app.state.model_name)
    ids = server.app.state.engine.tokenize(PROMPT)
    want = offline(server, PROMPT, max_tokens=3, temperature=0.0, prompt_logprobs=2, logprobs=2)
    token = server.app.state.engine.tokenizer.decode
    for max_tokens in (0, 3):
        out = client.completions.create(
            model=name, prompt=PROMPT, max_tokens=max_tokens, temperature=0, echo=True,
            logprobs=2,
        )  # fmt: skip
        choice = out.choices[0]
        lp = choice.logprobs
        assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
        assert lp.tokens is not None and lp.text_offset is not None
        n_out = len(want.outputs[0].token_ids) if max_tokens else 0
        assert len(lp.tokens) == len(ids) + n_out
        assert lp.tokens[: len(ids)] == [token([t]) for t in ids]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for i in range(1, len(ids)):
            assert lp.token_logprobs[i] == pytest.approx(
                want.prompt_logprobs[i][ids[i]].logprob, abs=1e-4
            )
            assert len(lp.top_logprobs[i]) == 2
        for j, tok in enumerate(want.outputs[0].token_ids[:n_out]):
            got = lp.token_logprobs[len(ids) + j]
            assert got == pytest.approx(want.outputs[0].logprobs[j][tok].logprob, abs=1e-4)
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
        if max_tokens == 0:
            assert choice.text == PROMPT and choice.finish_reason == "length"
            assert out.usage is not None and out.usage.completion_tokens == 0
        else:
            assert choice.text == PROMPT + want.outputs[0].text
        # streamed: the echo (with the prompt's logprobs) first, then the output
        chunks = list(
            client.completions.create(
                model=name,
                prompt=PROMPT,
                max_tokens=max_tokens,
                temperature=0,
                echo=True,
                logprobs=2,
                stream=True,
            )  # fmt: skip
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
        streamed = [x for c in chunks if c.choices and c.choices[0].logprobs
                    for x in c.choices[0].logprobs.token_logprobs or []]  # fmt: skip
        assert streamed[0] is None
        assert streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    with pytest.raises(openai.BadRequestError, match="max_tokens may be 0 only with echo"):
        client.completions.create(model=name, prompt=PROMPT, max_tokens=0)


def test_batched_prompts_answer_as_separate_requests(
    client: openai.OpenAI, server: ServerThread
) -> None:
    """``prompt`` as a list of strings or of token-id lists (issue 58): one choice per prompt x
    n in OpenAI's order (prompt p's i-th is index p*n+i), each what the prompt alone answers,
    usage summed; streamed too; the prompts share the cache as separate requests do."""
    name = str(server.app.state.model_name)
    engine = server.app.state.engine
    shared = "You are a careful assistant. Answer in one short sentence. " * 6
    prompts = [shared + q for q in ("Who wrote Hamlet?", "What is two plus two?", "Name a color.")]
    greedy = {"model": name, "max_tokens": 4, "temperature": 0, "extra_body": {"ignore_eos": True}}
    alone = [client.completions.create(prompt=p, **greedy) for p in prompts]
    server.app.state.engine_loop.call_sync(lambda e: e.flush_cache(), 60)
    for batch in (prompts, [engine.tokenize(p) for p in prompts]):
        out = client.completions.create(prompt=batch, n=2, **greedy)
        assert [c.index for c in out.choices] == list(range(6))
        for c in out.choices:
            assert c.text == alone[c.index // 2].choices[0].text, c.index
        assert out.usage is not None
        assert out.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)  # type: ignore[union-attr]
        assert out.usage.completion_tokens == 6 * 4
        server.app.state.engine_loop.call_sync(lambda e: e.flush_cache(), 60)
    # the prompts share their common prefix within the one request, as separate requests do
    out = client.completions.create(prompt=prompts, **greedy)
    details = out.usage.prompt_tokens_details  # type: ignore[union-attr]
    assert details is not None and details.cached_tokens is not None
    assert details.cached_tokens >= len(engine.tokenize(shared)) - 64, details
    chunks = list(
        client.completions.create(
            prompt=prompts, n=2, stream=True, stream_options={"include_usage": True}, **greedy
        )
    )
    texts: dict[int, str] = {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
    assert texts == {i: alone[i // 2].choices[0].text for i in range(6)}
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6 * 4
    with pytest.raises(openai.BadRequestError, match="choices one request may ask for"):
        client.completions.create(prompt=["x"] * 200, n=2, **greedy)


def test_generate_logprobs_in_sglang_shapes(server: ServerThread) -> None:
    body = {
        "text": PROMPT,
        "sampling_params": {"max_new_tokens": 3, "temperature": 0},
        "return_logprob": True,
        "top_logprobs_num": 2,
        "logprob_start_len": 0,
        "return_text_in_logprobs": True,
    }
    r = httpx.post(f"{server.base_url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    out_lps, out_tops = meta["output_token_logprobs"], meta["output_top_logprobs"]
    assert len(out_lps) == len(out_tops) == 3
    for (lp, tid, text), top in zip(out_lps, out_tops):
        assert lp <= 0 and isinstance(tid, int) and isinstance(text, str)
        assert len(top) == 2 and top[0][1] == tid and top[0][0] == pytest.approx(lp, abs=1e-6)
    in_lps, in_tops = meta["input_token_logprobs"], meta["input_top_logprobs"]
    n_prompt = meta["prompt_tokens"]
    assert len(in_lps) == len(in_tops) == n_prompt
    assert in_lps[0][0] is None and in_tops[0] is None
    assert all(lp <= 0 for lp, _, _ in in_lps[1:])


def test_beam_search_over_http(client: openai.OpenAI, server: ServerThread) -> None:
    name = str(server.app.state.model_name)
    want = offline(
        server, PROMPT, n=2, best_of=3, use_beam_search=True, max_tokens=5, early_stopping=True
    )
    out = client.completions.create(
        model=name,
        prompt=PROMPT,
        max_tokens=5,
        n=2,
        best_of=3,
        extra_body={"use_beam_search": True, "early_stopping": True},
    )
    assert [c.text for c in out.choices] == [c.text for c in want.outputs]
    r = httpx.post(
        f"{server.base_url}/generate",
        json={
            "text": PROMPT,
            "sampling_params": {
                "max_new_tokens": 5,
                "n": 2,
                "best_of": 3,
                "use_beam_search": True,
                "early_stopping": True,
            },
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert [item["output_ids"] for item in r.json()] == [c.token_ids for c in want.outputs]


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/v1/completions", {"n": 3, "best_of": 2}, "best_of"),
        ("/v1/completions", {"use_beam_search": True, "stream": True}, "stream"),
        ("/v1/completions", {"prompt_logprobs": 99}, "prompt_logprobs"),
        ("/v1/completions", {"use_beam_search": True, "top_p": 0.5}, "top_p"),
        ("/v1/completions", {"early_stopping": "sometimes"}, "early_stopping"),
        ("/generate", {"top_logprobs_num": 50}, "top_logprobs_num"),
        ("/generate", {"return_logprob": True, "logprob_start_len": 999}, "logprob_start_len"),
    ],
)
def test_bad_logprob_and_beam_fields_are_400(
    server: ServerThread, path: str, body: dict[str, Any], field: str
) -> None:
    name = str(server.app.state.model_name)
    if path == "/generate":
        payload: dict[str, Any] = {"text": PROMPT, "sampling_params": {"max_new_tokens": 2}}
        payload.update(body)
    else:
        payload = {"model": name, "prompt": PROMPT, "max_tokens": 2, **body}
    r = httpx.post(f"{server.base_url}{path}", json=payload, timeout=60)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]

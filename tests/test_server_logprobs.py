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

"""Chat template controls on the real SmolLM2 tokenizer (transformers renders the Jinja):
``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs`` and a template
of one's own (``chat_template`` knob / ``--chat-template``, file or text; per request when
trusted), offline and over HTTP."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_engine import ServerThread

from radixkv import Engine
from radixkv.engine.chat_template import load_chat_template, render_chat
from radixkv.server.app import create_app

pytestmark = pytest.mark.real_model

#: Renders ``enable_thinking`` and ``add_generation_prompt`` visibly.
TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    "{% if enable_thinking %}<think>{% endif %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PARTIAL = [*CHAT, {"role": "assistant", "content": "The capital of France is"}]


@pytest.fixture(scope="module")
def tok(real_model: Any) -> Any:
    return real_model.tokenizer


def text(tok: Any, ids: list[int]) -> str:
    return str(tok.decode(ids, skip_special_tokens=False))


def test_generation_prompt_on_and_off(tok: Any) -> None:
    on = text(tok, render_chat(tok, CHAT))
    off = text(tok, render_chat(tok, CHAT, add_generation_prompt=False))
    assert on.endswith("<|im_start|>assistant\n") and not off.endswith("assistant\n")
    assert on.startswith(off)


def test_continue_final_message_leaves_it_open(tok: Any) -> None:
    closed = text(tok, render_chat(tok, PARTIAL, add_generation_prompt=False))
    open_ = text(
        tok, render_chat(tok, PARTIAL, add_generation_prompt=False, continue_final_message=True)
    )
    assert open_.endswith("The capital of France is")
    assert closed.startswith(open_) and "<|im_end|>" in closed[len(open_) :]
    with pytest.raises(ValueError, match="continue_final_message"):
        render_chat(tok, PARTIAL, continue_final_message=True)  # with the generation prompt


def test_custom_template_and_kwargs(tok: Any) -> None:
    plain = text(tok, render_chat(tok, CHAT, chat_template=TEMPLATE))
    assert plain == "[user] What is the capital of France?\n[assistant]"
    thinking = render_chat(
        tok, CHAT, chat_template=TEMPLATE, chat_template_kwargs={"enable_thinking": True}
    )
    assert text(tok, thinking) == "[user] What is the capital of France?\n<think>[assistant]"
    with pytest.raises(ValueError, match="tokenize"):
        render_chat(tok, CHAT, chat_template_kwargs={"tokenize": False})


def test_load_chat_template(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE == load_chat_template(TEMPLATE)
    with pytest.raises(ValueError, match="neither a file"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_engine_knob_replaces_the_models_template(real_model: Any, tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    engine = Engine(real_model, dtype="float32", kv_cache_tokens=2048, chat_template=str(path))
    try:
        ids = engine.apply_chat_template(CHAT, chat_template_kwargs={"enable_thinking": True})
        assert text(real_model.tokenizer, ids).endswith("<think>[assistant]")
        (out,) = engine.chat(CHAT, chat_template_kwargs={"enable_thinking": True})
        assert out.prompt_token_ids == ids
    finally:
        engine.close()
    with pytest.raises(ValueError, match="chat template"):
        Engine(real_model, dtype="float32", kv_cache_tokens=2048, chat_template="no/such/file")


@pytest.fixture(scope="module")
def server(real_model: Any) -> Iterator[ServerThread]:
    engine = Engine(real_model, dtype="float32", kv_cache_tokens=4096)
    with ServerThread(create_app(engine, trust_request_chat_template=True)) as srv:
        yield srv
    engine.close()


def post(server: ServerThread, path: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = httpx.post(f"{server.base_url}{path}", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def test_http_template_fields_reach_the_render(server: ServerThread, tok: Any) -> None:
    think = post(
        server,
        "/tokenize",
        {
            "messages": CHAT,
            "chat_template": TEMPLATE,
            "chat_template_kwargs": {"enable_thinking": True},
        },
    )
    assert text(tok, think["tokens"]).endswith("<think>[assistant]")
    cont = post(
        server,
        "/tokenize",
        {"messages": PARTIAL, "add_generation_prompt": False, "continue_final_message": True},
    )
    assert cont["tokens"] == render_chat(
        tok, PARTIAL, add_generation_prompt=False, continue_final_message=True
    )
    chat = post(
        server,
        "/v1/chat/completions",
        {
            "messages": PARTIAL,
            "add_generation_prompt": False,
            "continue_final_message": True,
            "max_tokens": 3,
            "temperature": 0,
        },
    )
    assert chat["usage"]["prompt_tokens"] == cont["count"]
    custom = post(
        server,
        "/v1/chat/completions",
        {
            "messages": CHAT,
            "chat_template": TEMPLATE,
            "chat_template_kwargs": {"enable_thinking": True},
            "max_tokens": 1,
        },
    )
    assert custom["usage"]["prompt_tokens"] == think["count"]

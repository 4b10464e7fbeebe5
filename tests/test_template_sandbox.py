"""Issue 59, finding 2: a chat template a request brings (``--trust-request-chat-template``) is a
program. It renders in :class:`~radixkv.engine.template_sandbox.TemplateSandbox`'s processes,
bounded in time and memory (the work is killed at the bound, not just the wait), one render in
flight per key, and never under the tokenizer lock the engine thread decodes under. Written as
the attacks: nested ``range`` loops, a string multiplied past the memory bound, a template
rendering megabytes, one key sending several at once, while another tenant streams."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fake_engine import ServerThread

from radixkv.engine.chat_template import render_chat, render_chat_text
from radixkv.engine.template_sandbox import (
    TemplateBusyError,
    TemplateLimitError,
    TemplateSandbox,
)

#: loops for ~10^10 iterations (Jinja's sandbox caps one range at 100,000, not a nest of them)
LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"
#: allocates 4 GB
BIG = "{{ 'a' * 4000000000 }}"
CHAT = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi"}]
OWN = "{% for m in messages %}[{{ m.role }}|{{ m.content }}|{{ eos_token }}]{% endfor %}"


@pytest.fixture(scope="module")
def hf_tok() -> Any:
    from bench.tiny_model import byte_level_hf_tokenizer

    return byte_level_hf_tokenizer()


@pytest.fixture()
def sandbox() -> Iterator[TemplateSandbox]:
    box = TemplateSandbox(workers=2, timeout=1.5, memory_bytes=128 << 20, max_chars=100_000)
    try:
        yield box
    finally:
        box.check_integrity()
        box.close()


def _render(box: TemplateSandbox, tok: Any, template: str, key: Any = None) -> str:
    return render_chat_text(tok, CHAT, chat_template=template, sandbox=box, sandbox_key=key)


def test_sandboxed_render_is_transformers_render(sandbox: TemplateSandbox, hf_tok: Any) -> None:
    """The same text as transformers' ``apply_chat_template`` (the model's template and one of
    the request's, with the special tokens and ``chat_template_kwargs`` it sees), and the same
    ids once tokenized."""
    for template in (None, OWN):
        want = hf_tok.apply_chat_template(CHAT, chat_template=template, tokenize=False,
                                          add_generation_prompt=True)  # fmt: skip
        got = render_chat_text(hf_tok, CHAT, chat_template=template, sandbox=sandbox)
        assert got == want and got == render_chat_text(hf_tok, CHAT, chat_template=template)
    kw = {"flag": "ON"}
    tpl = "{{ flag }}{{ messages[-1].content }}"
    got = render_chat_text(hf_tok, CHAT, chat_template=tpl, chat_template_kwargs=kw,
                           sandbox=sandbox, add_generation_prompt=False)  # fmt: skip
    assert got == "ONHi"
    ids = hf_tok.apply_chat_template(CHAT, chat_template=OWN, add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert render_chat(hf_tok, CHAT, chat_template=OWN) == list(ids)
    with pytest.raises(ValueError, match="cannot apply the chat template"):
        _render(sandbox, hf_tok, "{{ raise_exception('no system role') }}")
    assert _render(sandbox, hf_tok, OWN).startswith("[user|Hello there|</s>]")


def test_a_looping_template_is_killed_at_the_time_bound(
    sandbox: TemplateSandbox, hf_tok: Any
) -> None:
    before = set(sandbox.pids())
    t0 = time.monotonic()
    with pytest.raises(TemplateLimitError, match=r"ran past 1.5 s and was stopped"):
        _render(sandbox, hf_tok, LOOPS)
    took = time.monotonic() - t0
    assert 1.4 <= took < 6, took
    gone = before - set(sandbox.pids())
    assert len(gone) == 1 and sandbox.killed == 1  # its process was stopped, not left looping
    (pid,) = gone
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert _render(sandbox, hf_tok, OWN).startswith("[user|")  # a fresh process serves the next


def test_a_template_past_the_memory_bound_is_stopped(sandbox: TemplateSandbox, hf_tok: Any) -> None:
    with pytest.raises(TemplateLimitError, match="memory"):
        _render(sandbox, hf_tok, BIG)
    with pytest.raises(TemplateLimitError, match="characters"):  # 200,000 > max_chars
        _render(sandbox, hf_tok, "{{ 'ab' * 100000 }}")
    assert _render(sandbox, hf_tok, OWN).startswith("[user|")


def test_one_key_renders_one_template_at_a_time(sandbox: TemplateSandbox, hf_tok: Any) -> None:
    """While key A's looping template holds a process, A's next render is refused (429) at
    once; key B renders in the other process."""
    errors: list[BaseException] = []
    started = threading.Event()

    def attack() -> None:
        started.set()
        try:
            _render(sandbox, hf_tok, LOOPS, key="A")
        except BaseException as exc:  # noqa: BLE001 - kept for the assertion below
            errors.append(exc)

    t = threading.Thread(target=attack)
    t.start()
    started.wait()
    deadline = time.monotonic() + 5
    while not sandbox.keys.in_flight("A") and time.monotonic() < deadline:
        time.sleep(0.005)
    t0 = time.monotonic()
    with pytest.raises(TemplateBusyError) as busy:
        _render(sandbox, hf_tok, OWN, key="A")
    assert busy.value.status == 429 and time.monotonic() - t0 < 0.5
    assert _render(sandbox, hf_tok, OWN, key="B").startswith("[user|")
    t.join(10)
    assert len(errors) == 1 and isinstance(errors[0], TemplateLimitError)


# ------------------------------------------------------------------ through the server


def test_a_tenants_template_leaves_another_tenants_stream_alone(hf_tok: Any) -> None:
    """Two keys on a server that trusts request templates. Key A's chat with a looping template
    is answered 400 (``template_limit``) at the bound, A's second one meanwhile 429; key B's
    stream, running all along, never waits long for a token (before issue 59 A's template held
    the tokenizer lock for as long as it looped, and B's decode waited on it), and B's chat with
    the server's own template answers promptly."""
    from bench.tiny_model import tiny_loaded_model
    from radixkv.engine.engine import Engine
    from radixkv.server.app import create_app

    engine = Engine(tiny_loaded_model(tokenizer=hf_tok), page_size=4, kv_cache_tokens=8192,
                    attention_backend="torch", dtype="float32")  # fmt: skip
    app = create_app(engine, api_key=["sk-tenant-a-0123456789", "sk-tenant-b-0123456789"],
                     trust_request_chat_template=True)  # fmt: skip
    a = {"Authorization": "Bearer sk-tenant-a-0123456789"}
    b = {"Authorization": "Bearer sk-tenant-b-0123456789"}
    chat = {"messages": CHAT, "max_tokens": 4, "temperature": 0}
    with ServerThread(app) as srv:
        url = srv.base_url
        # warm: both sandbox processes have started, and B's stream path ran once
        r = httpx.post(url + "/v1/chat/completions", json={**chat, "chat_template": OWN},
                       headers=a, timeout=90)  # fmt: skip
        assert r.status_code == 200, r.text
        gaps: list[float] = []
        stream_done = threading.Event()

        def stream() -> None:
            body = {"prompt": "The quick brown fox", "max_tokens": 400, "ignore_eos": True,
                    "temperature": 0, "stream": True}  # fmt: skip
            last = time.monotonic()
            with httpx.stream("POST", url + "/v1/completions", json=body, headers=b,
                              timeout=30) as resp:  # fmt: skip
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        now = time.monotonic()
                        gaps.append(now - last)
                        last = now
            stream_done.set()

        attack: dict[str, Any] = {}

        def attacker() -> None:
            t0 = time.monotonic()
            r = httpx.post(url + "/v1/chat/completions", json={**chat, "chat_template": LOOPS},
                           headers=a, timeout=60)  # fmt: skip
            attack.update(status=r.status_code, body=r.json(), took=time.monotonic() - t0)

        t_attack = threading.Thread(target=attacker)
        t_attack.start()
        time.sleep(0.3)  # A's template is looping in its process now
        t_stream = threading.Thread(target=stream)
        t_stream.start()
        second = httpx.post(url + "/v1/chat/completions", json={**chat, "chat_template": OWN},
                            headers=a, timeout=30)  # fmt: skip
        assert second.status_code == 429, second.text
        assert second.json()["error"]["code"] == "key_limit"
        t0 = time.monotonic()
        own = httpx.post(url + "/v1/chat/completions", json=chat, headers=b, timeout=30)
        assert own.status_code == 200 and time.monotonic() - t0 < 1.0, own.text
        t_attack.join(60)
        t_stream.join(60)
        assert stream_done.is_set()
        assert attack["status"] == 400, attack
        assert attack["body"]["error"]["code"] == "template_limit", attack
        assert attack["took"] < 2.0 + 6, attack  # the bound (2 s) and the process's replacement
        assert len(gaps) > 100 and max(gaps) < 0.5, (len(gaps), max(gaps))
        # and the server still serves A's ordinary template afterwards
        r = httpx.post(url + "/v1/chat/completions", json={**chat, "chat_template": OWN},
                       headers=a, timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text

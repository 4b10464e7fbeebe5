"""The engine's tokenizer is shared by the server's event loop and the engine thread."""

from __future__ import annotations

import random
import threading
import time

import pytest

from radixkv.engine.tokenizer_lock import LockedTokenizer


class Recorder:
    """A tokenizer stand-in that fails if two calls ever overlap."""

    eos_token_id = 2

    def __init__(self) -> None:
        self.busy = False
        self.calls = 0

    def _enter(self) -> None:
        assert not self.busy, "two threads inside the tokenizer at once"
        self.busy = True
        self.calls += 1
        time.sleep(0.0002)  # release the GIL while "inside", as the Rust tokenizer does

    def encode(self, text: str, **_: object) -> list[int]:
        self._enter()
        try:
            return list(text.encode())
        finally:
            self.busy = False

    def decode(self, ids: list[int], **_: object) -> str:
        self._enter()
        try:
            return bytes(ids).decode(errors="replace")
        finally:
            self.busy = False


def test_calls_are_serialised_and_attributes_pass_through():
    inner = Recorder()
    tok = LockedTokenizer(inner)
    assert tok.eos_token_id == 2 and tok.wrapped is inner
    errors: list[BaseException] = []

    def hammer(fn, arg):
        try:
            for _ in range(300):
                fn(arg)
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion below
            errors.append(exc)

    threads = [
        threading.Thread(target=hammer, args=(tok.encode, "hello world")),
        threading.Thread(target=hammer, args=(tok.decode, [104, 105])),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and inner.calls == 600


@pytest.mark.real_model
def test_engine_wraps_the_real_tokenizer(real_model):
    from radixkv import Engine

    engine = Engine(real_model, dtype="float32", kv_cache_tokens=256)
    assert isinstance(engine.tokenizer, LockedTokenizer)
    ids = engine.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert engine.tokenizer.decode(ids).startswith("<|im_start|>")


@pytest.mark.real_model
def test_fast_encode_returns_transformers_ids(real_model):
    """``encode`` of a fast tokenizer skips transformers' Python layer for the Rust backend: the
    same ids, with and without special tokens, on random, special-token and edge-case text."""
    inner = getattr(real_model.tokenizer, "wrapped", real_model.tokenizer)
    tok = LockedTokenizer(inner)
    assert inner.is_fast and tok._backend is not None  # the direct path is the one under test
    # the offset-free batch call where this tokenizers has it (>= 0.20: the version installed)
    assert tok._encode_batch == getattr(
        tok._backend, "encode_batch_fast", tok._backend.encode_batch
    )
    rng = random.Random(0)
    texts = [inner.decode([rng.randrange(len(inner)) for _ in range(n)]) for n in (1, 7, 300)]
    texts += [inner.decode([i]) for i in range(0, 400, 3)]
    texts += ["", " ", "  two leading spaces", "<|im_start|>user\nhi<|im_end|>\n", "a\r\nb\tc"]
    texts += ["<|endoftext|>x<|endoftext|>", "caf\u00e9 \u00e9\u0301 \U0001f600 \x00", " " * 40]
    for text in texts:
        for special in (False, True):
            assert tok.encode(text, add_special_tokens=special) == inner.encode(
                text, add_special_tokens=special
            ), (text, special)
    assert tok.encode(texts[2]) == inner.encode(texts[2])
    # other arguments go through transformers unchanged
    assert tok.encode(texts[2], max_length=5, truncation=True) == inner.encode(
        texts[2], max_length=5, truncation=True
    )


@pytest.mark.real_model
def test_fast_decode_returns_transformers_text(real_model):
    """``decode(ids, clean_up_tokenization_spaces=False)`` (the incremental detokenizer's call)
    skips transformers' Python layer: the same text for random windows, special tokens and
    partial UTF-8, with and without skipping special tokens; other calls go through it."""
    inner = getattr(real_model.tokenizer, "wrapped", real_model.tokenizer)
    tok = LockedTokenizer(inner)
    rng = random.Random(1)
    specials = list(inner.all_special_ids)
    windows = [[rng.randrange(len(inner)) for _ in range(rng.randrange(0, 5))] for _ in range(500)]
    windows += [[s, rng.randrange(len(inner))] for s in specials] + [specials, []]
    windows += [
        inner.encode("caf\u00e9 \U0001f600", add_special_tokens=False)[:k] for k in range(6)
    ]
    for ids in windows:
        for skip in (False, True):
            got = tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
            want = inner.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
            assert got == want, (ids, skip)
    assert tok.decode(windows[0]) == inner.decode(windows[0])

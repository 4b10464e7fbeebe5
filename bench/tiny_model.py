"""A tiny random Llama with a byte-level tokenizer: the real engine's code paths, in milliseconds.

``tiny_loaded_model()`` returns a :class:`~radixkv.model.loader.LoadedModel` that
``Engine(model=...)`` accepts: a 2-layer, 64-wide random ``LlamaForCausalLM`` (seeded, so every
process builds the same weights) and :class:`ByteTokenizer` (token id = byte + 3, with a chat
template). The soak run (``bench.soak --tiny``) and the fuzz and fault-injection tests use it where
the SmolLM2 weights are not the point: every request still goes through the real scheduler,
radix tree, KV pool, tiers and sampler. ``save_tiny_model_dir(path)`` writes the same model
with a Hugging Face byte-level tokenizer of the same ids as a local model directory, which real
``radixkv serve --model PATH`` processes load (the cluster tests, ``bench_router --model tiny``).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ByteTokenizer",
    "TINY_VOCAB",
    "byte_level_hf_tokenizer",
    "save_tiny_model_dir",
    "tiny_loaded_model",
]

_OFFSET = 3
TINY_VOCAB = 320
"""Vocabulary of the tiny model (256 bytes + 3 specials, rounded up)."""


class ByteTokenizer:
    """Byte-level tokenizer: token id = byte value + 3 (0 pad, 1 bos, 2 eos)."""

    eos_token_id = 2
    bos_token_id = 1
    pad_token_id = 0
    chat_template = "<|role|>content lines"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``."""
        return [b + _OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: list[int], skip_special_tokens: bool = True, **_: object) -> str:
        """Text of ``ids`` (ids outside the byte range are dropped)."""
        return bytes(i - _OFFSET for i in ids if _OFFSET <= i < 256 + _OFFSET).decode(
            "utf-8", errors="replace"
        )

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        **_: Any,
    ) -> Any:
        """``<|role|>content\\n`` per message (plus ``<|assistant|>``); ids or text."""
        text = "".join(f"<|{m['role']}|>{m.get('content') or ''}\n" for m in messages)
        if add_generation_prompt:
            text += "<|assistant|>"
        return self.encode(text) if tokenize else text


def tiny_loaded_model(
    seed: int = 0,
    max_position_embeddings: int = 512,
    tokenizer: Any = None,
    vocab_size: int = TINY_VOCAB,
    name: str = "tiny-llama",
    hidden_size: int = 64,
    num_attention_heads: int = 4,
) -> Any:
    """The tiny random Llama as a ``LoadedModel`` (float32, ``seed``), with ``tokenizer``
    (default :class:`ByteTokenizer`). Head dim ``hidden_size / num_attention_heads`` (16 by
    default; e.g. ``hidden_size=256`` gives 64, a head dim the native bf16 kernel's fast path
    serves); 2 KV heads."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from radixkv.model.loader import LoadedModel

    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
    )
    torch.manual_seed(seed)
    hf = LlamaForCausalLM(cfg).eval()
    tok = tokenizer if tokenizer is not None else ByteTokenizer()
    return LoadedModel(hf_model=hf, tokenizer=tok, config=cfg, name=name)


def byte_level_hf_tokenizer() -> Any:
    """A Hugging Face fast tokenizer with :class:`ByteTokenizer`'s ids (0 pad, 1 bos, 2 eos,
    byte ``b`` = ``b + 3``) that ``save_pretrained`` / ``AutoTokenizer`` round-trip."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # one printable character per byte
    by_byte = {ord(c) if ord(c) < 256 else None: c for c in alphabet}
    # GPT-2's byte-to-unicode map: bytes outside the printable ranges become U+0100 + n
    chars, n = [], 0
    for b in range(256):
        if b in by_byte:
            chars.append(by_byte[b])
        else:
            chars.append(chr(256 + n))
            n += 1
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2} | {c: b + _OFFSET for b, c in enumerate(chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    return fast


def save_tiny_model_dir(path: str, seed: int = 0, max_position_embeddings: int = 512) -> str:
    """Write the tiny random Llama (``seed``) with :func:`byte_level_hf_tokenizer` as a local
    Hugging Face directory (config.json, safetensors, tokenizer files) that ``radixkv serve
    --model PATH`` loads: real replica processes in milliseconds per token. Returns ``path``."""
    loaded = tiny_loaded_model(seed=seed, max_position_embeddings=max_position_embeddings)
    loaded.hf_model.save_pretrained(path)
    byte_level_hf_tokenizer().save_pretrained(path)
    return path

"""Write a transformers model as a GGUF file the way llama.cpp's ``convert_hf_to_gguf.py`` does:
its tensor names (gguf-py's ``TensorNameMap``), its metadata keys, its value transforms (Llama's
q/k row permutation, Gemma's norms stored as ``1 + w``, Llama 3's RoPE as a ``rope_freqs``
tensor), 1-D tensors in F32 and the rest in the file type (Q8_0 falling back to F16 where a row
is not a whole number of blocks), and the tokenizer as llama.cpp's ``tokenizer.ggml.*`` keys.

:func:`write_gguf` returns the weights the file holds, dequantised, in the model's own layout:
what a correct reader must end up with (the oracle of a quantized file's test).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["GGUF_ARCH", "as_stored", "llama3_rope_factors", "stored_model", "write_gguf"]

#: transformers model_type -> the GGUF architecture llama.cpp writes it as
GGUF_ARCH = {
    "llama": "llama",
    "mistral": "llama",  # llama.cpp converts Mistral as a Llama
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
    "granite": "granite",
    "smollm3": "smollm3",
    "olmo2": "olmo2",
}


def _llama_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's ``LlamaModel.permute``: rotate-half q/k rows to interleaved pairs."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _rope_parameters(config: Any) -> dict[str, Any]:
    params = getattr(config, "rope_parameters", None) or {}
    return dict(params.get("full_attention", params))


def llama3_rope_factors(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """The ``rope_freqs`` tensor llama.cpp writes for ``rope_type: llama3`` parameters ``rope``:
    the divisor of each frequency (convert_hf_to_gguf.py's computation, in float32)."""
    base = float(rope["rope_theta"])
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor = rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def _byte_vocab() -> tuple[list[str], list[int]]:
    """bench/tiny_model.py's byte-level vocabulary as llama.cpp's ``gpt2`` token list."""
    from bench.tiny_model import byte_level_hf_tokenizer

    tok = byte_level_hf_tokenizer()
    by_id = {i: t for t, i in tok.get_vocab().items()}
    tokens = [by_id[i] for i in range(len(by_id))]
    types = [3 if t in ("<pad>", "<s>", "</s>") else 1 for t in tokens]  # CONTROL, NORMAL
    return tokens, types


def _tensors(model: Any, arch: str) -> list[tuple[str, torch.Tensor]]:
    """``(gguf name, tensor in the file's layout)`` for every weight, as llama.cpp converts."""
    import gguf

    config = model.config
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)
    tied = bool(config.tie_word_embeddings)
    out = []
    for hf_name, t in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue
        base, _, suffix = hf_name.rpartition(".")
        name = names.get_name(base)
        assert name is not None, f"{arch}: no GGUF name for {hf_name}"
        t = t.detach().float().clone()
        if arch == "llama" and base.endswith(("q_proj", "k_proj")):
            heads = config.num_attention_heads
            if base.endswith("k_proj"):
                heads = config.num_key_value_heads
            t = _llama_permute(t, heads)
        if arch == "gemma3" and hf_name.endswith("norm.weight"):
            t = t + 1
        out.append((f"{name}.{suffix}", t))
    rope = _rope_parameters(config)
    if arch == "llama" and rope.get("rope_type") == "llama3":
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        out.append(("rope_freqs.weight", torch.from_numpy(llama3_rope_factors(rope, head_dim))))
    return out


def _quantize(t: np.ndarray, qtype: str) -> tuple[np.ndarray, Any]:
    """``(data, ggml type)`` as llama.cpp stores ``t`` in a ``qtype`` file."""
    import gguf

    q = gguf.GGMLQuantizationType
    if t.ndim == 1 or qtype == "F32":
        return t.astype(np.float32), q.F32
    kind = getattr(q, qtype)
    try:
        return gguf.quants.quantize(t, kind), kind
    except gguf.QuantError:  # a row that is not whole blocks: llama.cpp falls back to F16
        return gguf.quants.quantize(t, q.F16), q.F16


def _metadata(w: Any, model: Any, arch: str, name: str) -> None:
    config = model.config
    rope = _rope_parameters(config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    w.add_name(name)
    w.add_vocab_size(config.vocab_size)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    if rope.get("rope_type") == "linear":
        import gguf

        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope["factor"]))
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
    if arch == "phi3":
        rotary = int(head_dim * rope.get("partial_rotary_factor", 1.0))
        w.add_rope_dimension_count(rotary)
    window = getattr(config, "sliding_window", None)
    # Phi-3's and Gemma 3's as llama.cpp writes them; Mistral's (a llama file) under the same
    # key, which llama.cpp's converter leaves out (llama.cpp runs Mistral without its window)
    if window and arch in ("llama", "phi3", "gemma3"):
        w.add_sliding_window(int(window))
    if arch == "gemma3":
        types = config.layer_types
        w.add_sliding_window_pattern([t == "sliding_attention" for t in types])
        local = config.rope_parameters["sliding_attention"]["rope_theta"]
        w.add_rope_freq_base_swa(float(local))
        if config.final_logit_softcapping:
            w.add_final_logit_softcapping(float(config.final_logit_softcapping))
    tokens, types = _byte_vocab()
    assert len(tokens) == config.vocab_size, (len(tokens), config.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    # a byte-level vocabulary has no merges, and gguf-py writes no empty array: the scores are
    # what transformers then derives (no) merges from
    w.add_token_scores([0.0] * len(tokens))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )


def write_gguf(
    model: Any,
    path: str | Path,
    qtype: str = "F32",
    name: str = "",
    extra: dict[str, np.ndarray] | None = None,
    quantize: Callable[[str, np.ndarray], tuple[np.ndarray, Any]] | None = None,
) -> dict:
    """Write ``model`` (a transformers causal LM) to ``path`` as llama.cpp would, its 2-D weights
    in ``qtype`` (``"F32"``, ``"F16"``, ``"Q8_0"``, ...), plus the ``extra`` tensors (by GGUF
    name, F32). Returns the model's state dict with the values the file holds (each weight
    through the file's type and back). ``quantize(gguf_name, values)``, where given, says what
    each 2-D tensor is stored as instead (``(data, ggml type)``; the returned state dict is then
    not the file's: read the file back for an oracle)."""
    import gguf

    arch = GGUF_ARCH[model.config.model_type]
    writer = gguf.GGUFWriter(str(path), arch)
    _metadata(writer, model, arch, name or f"tiny-{model.config.model_type}")
    for gguf_name, t in _tensors(model, arch):
        values = t.numpy()
        if quantize is not None and values.ndim == 2:
            data, kind = quantize(gguf_name, values)
        else:
            data, kind = _quantize(values, qtype)
        writer.add_tensor(gguf_name, data, raw_dtype=kind)
    for gguf_name, data in (extra or {}).items():
        writer.add_tensor(gguf_name, data.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return as_stored(model, qtype)


def as_stored(model: Any, qtype: str) -> dict[str, torch.Tensor]:
    """``model``'s weights as a ``qtype`` file holds them, dequantised, in the model's layout
    (llama.cpp's permutations move whole rows, so they commute with row-wise quantisation)."""
    import gguf

    out = {}
    for hf_name, t in model.state_dict().items():
        t = t.detach().float()
        data, kind = _quantize(t.numpy(), qtype)
        if kind != gguf.GGMLQuantizationType.F32:
            t = torch.from_numpy(gguf.quants.dequantize(data, kind).copy()).reshape(t.shape)
        out[hf_name] = t
    return out


def stored_model(model: Any, qtype: str) -> Any:
    """A copy of ``model`` with the weights a ``qtype`` file holds (the quantized oracle)."""
    copy_ = copy.deepcopy(model)
    copy_.load_state_dict(as_stored(model, qtype))
    return copy_

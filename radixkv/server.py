"""radixkv.server: the HTTP front end (FastAPI) of the radixkv engine.

``create_app(engine, api_key=None, max_waiting=1024, model_name=None)`` builds the app (see
:mod:`radixkv.server.app`); ``radixkv serve`` (:mod:`radixkv.server.cli`) runs it with uvicorn.
The engine is driven by one background thread (:mod:`radixkv.server.engine_loop`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from radixkv.package_folders import package_path

#: This module is the package ``radixkv.server``; its modules live in ``server/`` (see
#: :mod:`radixkv.package_folders`).
__path__ = package_path(__file__, "server")

__all__ = ["create_app"]

if TYPE_CHECKING:
    from radixkv.server.app import create_app


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from radixkv.server.app import create_app

        return create_app
    raise AttributeError(f"module 'radixkv.server' has no attribute {name!r}")

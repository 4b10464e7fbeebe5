"""The dashboard page: one self-contained HTML document (CSS and JS inlined, nothing fetched from
elsewhere) built from ``static/dashboard.{html,css,js}`` shipped in the package.

``render_page()`` is the live page served at ``GET /dashboard`` (it polls ``/cache/stats`` and
``/cache/tree``); ``render_page(data)`` is a static report with ``data`` inlined (``radixkv
simulate --html``): ``{"title": str, "stats": {...}, "history": [sample, ...], "tree": tree_view
document}`` in the schemas of :mod:`radixkv.server.stats_history` and
:mod:`radixkv.cache.tree_view`. Importing this module costs nothing (no FastAPI, no torch).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

__all__ = ["STATIC_DIR", "render_page"]

STATIC_DIR = Path(__file__).resolve().parent / "static"


@cache
def _assets() -> tuple[str, str, str]:
    return tuple(  # type: ignore[return-value]
        (STATIC_DIR / f"dashboard.{ext}").read_text(encoding="utf-8")
        for ext in ("html", "css", "js")
    )


def _inline_json(data: Any) -> str:
    """``data`` as JSON safe inside a ``<script>`` element (no ``</script>``, no ``<!--``)."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return (
        text.replace("<", "\\u003c")
        .replace(">", "\\u003e")
        .replace("&", "\\u0026")
        .replace("\u2028", "\\u2028")
        .replace("\u2029", "\\u2029")
    )


def render_page(data: dict[str, Any] | None = None) -> str:
    """The dashboard HTML: live (``data`` None) or a static report of ``data``."""
    html, css, js = _assets()
    head, rest = html.split("/*__CSS__*/", 1)
    middle, rest = rest.split("/*__DATA__*/null", 1)
    before_js, tail = rest.split("/*__JS__*/", 1)
    payload = "null" if data is None else _inline_json(data)
    return "".join(
        (head, css, middle, payload, before_js, js.replace("</script", "<\\/script"), tail)
    )

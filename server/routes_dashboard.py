"""The cache dashboard: ``GET /dashboard`` (the page) and ``GET /cache/tree`` (its tree API).

``/cache/tree?max_nodes=&min_tokens=`` answers the :mod:`radixkv.cache.tree_view` document of the
engine's radix tree, taken on the engine thread between two steps. ``text`` (``"show"`` /
``"hide"``, the ``--dashboard-text`` flag) decides whether node snippets carry decoded prompt
text; salts are only ever shown as a keyed hash (the key is drawn per app).

Auth: with an API key both need it: ``/cache/tree`` as ``Authorization: Bearer KEY`` (like every
route), ``/dashboard`` also as ``?key=KEY`` (a browser cannot send a header when it navigates;
the page drops the key from the address bar and sends it as a Bearer header from then on).
Without it ``/dashboard`` answers 401 with a small form asking for the key (to browsers) or the
JSON error (to everything else).
"""

from __future__ import annotations

import html
import os
import secrets
from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from .context import ServerContext
from .dashboard import render_page
from .protocol import APIError, error_body

DASHBOARD_TEXT = ("show", "hide")
MAX_TREE_NODES = 5000

_LOGIN = """<!doctype html><html lang="en"><head><meta charset="utf-8">
<meta name="referrer" content="no-referrer"><title>radixkv: API key needed</title>
<style>body{{font-family:"DejaVu Sans",sans-serif;background:#f5f7fa;color:#1f2933;display:flex;
justify-content:center;padding-top:15vh}}form{{background:#fff;border:1px solid #e3e8ef;
border-radius:10px;padding:24px 28px}}input{{font:inherit;padding:4px 8px;margin:0 8px}}</style>
</head><body><form method="get" action="dashboard"><h2>radixkv dashboard</h2>
<p>{message}</p><label>API key<input type="password" name="key" autofocus></label>
<button type="submit">Open</button></form></body></html>"""


def dashboard_routes(
    ctx: ServerContext,
    *,
    api_key: str | Sequence[str] | None = None,
    text: str = "show",
    multi_tenant: bool = False,
) -> APIRouter:
    """``/dashboard`` and ``/cache/tree`` of one app (``text``: ``"show"`` or ``"hide"``).

    ``api_key``: the key (or keys) ``/dashboard`` accepts. ``multi_tenant`` (the keys are tenants
    with caches of their own): both answer 403, since the page would show every tenant's cache
    to each of them."""
    if text not in DASHBOARD_TEXT:
        raise ValueError(f"dashboard_text must be one of {DASHBOARD_TEXT}, got {text!r}")
    from radixkv.cache.tree_view import tree_view

    engine_loop = ctx.engine_loop
    salt_key = os.urandom(32)
    keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    router = APIRouter()

    def refuse_tenants() -> None:
        if multi_tenant:
            raise APIError(
                403,
                "The cache dashboard shows every tenant's cache, so it is off when API keys are "
                "tenants (--salt-from-api-key).",
                type="permission_error",
                code="dashboard_disabled",
            )

    @router.get("/cache/tree", dependencies=ctx.auth)
    async def cache_tree(
        max_nodes: int = Query(500, ge=1, le=MAX_TREE_NODES, description="real nodes shown"),
        min_tokens: int = Query(0, ge=0, description="fold subtrees with fewer tokens"),
    ) -> Response:
        refuse_tenants()

        def snapshot(engine: Any) -> dict[str, Any] | None:
            tree = getattr(engine, "tree", None)
            if tree is None:
                return None
            decode = None
            tokenizer = getattr(engine, "tokenizer", None)
            if text == "show" and tokenizer is not None:
                decode = tokenizer.decode
            return tree_view(
                tree,
                max_nodes=max_nodes,
                min_tokens=min_tokens,
                decode=decode,
                salt_key=salt_key,
                tiers=getattr(engine, "tiers", None),
            )

        doc = await engine_loop.call(snapshot)
        if doc is None:
            raise APIError(
                404, "this engine has no radix tree to show", type="not_found_error", code="no_tree"
            )
        return JSONResponse(doc)

    @router.get("/dashboard", include_in_schema=False)
    async def dashboard(request: Request, key: str | None = None) -> Response:
        if keys and not _authorized(request, key, keys):
            message = "This server needs its API key." if key is None else "Wrong API key."
            if "text/html" in request.headers.get("accept", ""):
                return HTMLResponse(_LOGIN.format(message=html.escape(message)), status_code=401)
            return JSONResponse(
                error_body(
                    "Incorrect or missing API key: open /dashboard?key=<key> or send the header "
                    "'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                ),
                status_code=401,
            )
        refuse_tenants()
        return HTMLResponse(
            render_page(),
            headers={"Cache-Control": "no-store", "Referrer-Policy": "no-referrer"},
        )

    return router


def _authorized(request: Request, key: str | None, keys: list[str]) -> bool:
    """The key from ``?key=`` or a Bearer header is one of ``keys`` (compared with all of them,
    in constant time each)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    given = [token.strip()] if scheme.lower() == "bearer" else []
    if key is not None:
        given.append(key)
    ok = False
    for g in given:
        data = g.encode("utf-8", "surrogatepass")
        for k in keys:
            ok |= secrets.compare_digest(data, k.encode("utf-8", "surrogatepass"))
    return ok

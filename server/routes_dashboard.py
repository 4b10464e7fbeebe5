"""The cache dashboard: ``GET /dashboard`` (the page) and ``GET /cache/tree`` (its tree API).

``/cache/tree?max_nodes=&min_tokens=`` answers the :mod:`radixkv.cache.tree_view` document of the
engine's radix tree, taken on the engine thread between two steps. ``text`` (``"show"`` /
``"hide"``, the ``--dashboard-text`` flag) decides whether node snippets carry decoded prompt
text; salts are only ever shown as a keyed hash (the key is drawn per app).

Auth: ``/cache/tree`` shows every namespace's cache, so it needs the admin key (``ctx.admin``;
with tenants and no admin key it is closed). ``/dashboard`` itself is a page without data, served
to anyone; its script sends the key as a Bearer header, taking it from the URL fragment
(``/dashboard#key=KEY``: a fragment never reaches the server, so no access log holds it, and
the script drops it from the address bar) or from a prompt. A key in the query string
(``?key=``) is refused with 400: it would land in access logs and browser history.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from .context import ServerContext
from .dashboard import render_page
from .protocol import APIError

if TYPE_CHECKING:
    from radixkv.engine.api import EngineAPI

DASHBOARD_TEXT = ("show", "hide")
MAX_TREE_NODES = 5000


def dashboard_routes(ctx: ServerContext, *, text: str = "show") -> APIRouter:
    """``/dashboard`` and ``/cache/tree`` of one app (``text``: ``"show"`` or ``"hide"``)."""
    if text not in DASHBOARD_TEXT:
        raise ValueError(f"dashboard_text must be one of {DASHBOARD_TEXT}, got {text!r}")
    from radixkv.cache.tree_view import tree_view

    engine_loop = ctx.engine_loop
    salt_key = os.urandom(32)
    router = APIRouter()

    @router.get("/cache/tree", dependencies=ctx.admin)
    async def cache_tree(
        max_nodes: int = Query(500, ge=1, le=MAX_TREE_NODES, description="real nodes shown"),
        min_tokens: int = Query(0, ge=0, description="fold subtrees with fewer tokens"),
    ) -> Response:
        def snapshot(engine: EngineAPI) -> dict[str, Any] | None:
            tree = engine.tree
            if tree is None:
                return None
            decode = None
            tokenizer = engine.tokenizer
            if text == "show" and tokenizer is not None:
                decode = tokenizer.decode
            return tree_view(
                tree,
                max_nodes=max_nodes,
                min_tokens=min_tokens,
                decode=decode,
                salt_key=salt_key,
                tiers=engine.tiers,
            )

        doc = await engine_loop.call(snapshot)
        if doc is None:
            raise APIError(
                404, "this engine has no radix tree to show", type="not_found_error", code="no_tree"
            )
        return JSONResponse(doc)

    @router.get("/dashboard", include_in_schema=False)
    async def dashboard(request: Request) -> Response:
        if "key" in request.query_params:
            raise APIError(
                400,
                "Do not put the API key in the query string (access logs and browser history "
                "keep it): open /dashboard#key=<admin key>, or /dashboard and type it when asked",
                param="key",
                code="key_in_query",
            )
        return HTMLResponse(
            render_page(),
            headers={"Cache-Control": "no-store", "Referrer-Policy": "no-referrer"},
        )

    return router

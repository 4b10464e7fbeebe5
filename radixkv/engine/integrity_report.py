"""An integrity report of a live engine: ``check_integrity()`` plus the pages nobody owns.

:func:`integrity_report` runs on the engine's own thread (the server's ``GET /cache/integrity``
calls it through the engine loop) and never raises: a broken invariant is reported, not thrown.

A device page is *leaked* when the allocator counts it used but neither the prefix tree nor any
live sequence holds it; a host page when the host pool counts it used but no tree node holds it.
Both are 0 in a healthy engine at any moment, busy or idle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from radixkv.cache.allocator import BlockAllocator
    from radixkv.cache.radix_tree import RadixTree
    from radixkv.cache.tiers import TieredCache
    from radixkv.engine.beam_runner import BeamRunner
    from radixkv.engine.kv_manager import KVManager
    from radixkv.engine.lifecycle import SequenceLifecycle
    from radixkv.engine.scheduler import Scheduler
    from radixkv.engine.virtual_layout import VirtualLayout

__all__ = ["AuditedEngine", "check_engine_integrity", "integrity_report"]


class AuditedEngine(Protocol):
    """The parts of the engine the checks read (:class:`radixkv.Engine` has them)."""

    @property
    def scheduler(self) -> Scheduler: ...
    @property
    def kv(self) -> KVManager: ...
    @property
    def lifecycle(self) -> SequenceLifecycle: ...
    @property
    def beams(self) -> BeamRunner: ...
    @property
    def virtual_layout(self) -> VirtualLayout | None: ...
    @property
    def tiers(self) -> TieredCache | None: ...
    @property
    def allocator(self) -> BlockAllocator: ...
    @property
    def tree(self) -> RadixTree: ...

    def check_integrity(self) -> None: ...
    def stats(self) -> dict[str, Any]: ...


def check_engine_integrity(engine: AuditedEngine) -> None:
    """The body of :meth:`radixkv.Engine.check_integrity`: raise AssertionError if any invariant
    of the tree, allocator, page tables, lifecycle, virtual layout or tiers is broken."""
    live = list(engine.scheduler.running)
    for s in engine.scheduler.waiting:
        assert not s.pages and s.lock_node is None, "a waiting sequence holds pages"
    engine.kv.check_integrity(live)
    queued = {id(s) for s in (*engine.scheduler.running, *engine.scheduler.waiting)}
    engine.lifecycle.check_integrity(lambda s: id(s) in queued, engine.beams.searches)
    if engine.virtual_layout is not None:
        engine.virtual_layout.check_integrity(live)
    if engine.tiers is not None:
        engine.tiers.check_integrity()


def integrity_report(engine: AuditedEngine) -> dict[str, Any]:
    """``{"ok", "error", "leaked_pages", "leaked_host_pages", "pages_used", "pages_cached",
    "running", "waiting"}`` for ``engine`` (call it on the engine's thread)."""
    error = None
    try:
        engine.check_integrity()
    except Exception as exc:  # reported, not raised: the caller wants the whole picture
        error = f"{type(exc).__name__}: {exc}"
    alloc = engine.allocator
    owned = set(engine.tree.all_pages())
    for seq in engine.scheduler.running:
        owned.update(seq.pages)
    leaked = [p for p in range(alloc.pages_touched) if alloc.refcount(p) > 0 and p not in owned]
    leaked_host = 0
    host = engine.tiers.host if engine.tiers is not None else None
    if host is not None:
        held = set(engine.tree.all_host_pages())
        halloc = host.allocator
        leaked_host = sum(
            1 for p in range(halloc.num_pages) if halloc.refcount(p) > 0 and p not in held
        )
    stats = engine.stats()
    return {
        "ok": error is None and not leaked and not leaked_host,
        "error": error,
        "leaked_pages": len(leaked),
        "leaked_host_pages": leaked_host,
        "pages_used": stats.get("pages_used"),
        "pages_cached": stats.get("pages_cached"),
        "running": stats.get("running"),
        "waiting": stats.get("waiting"),
    }

"""The engine side of ``kv_layout="virtual"``: keeps each running sequence's virtual range
(:class:`~radixkv.model.virtual_kv.VirtualKV`) mapped to its page table.

Mapping work is batched per step: before the forward the batch's sequences are synced (their new
pages mapped), after the step every running sequence is synced again (pages the tree replaced on
publish, copy-on-write tails), and a sequence the KV manager releases (finish, abort, preemption)
is unmapped at once. When the mappings would pass ``vm.max_map_count`` the step runs on the
paged backend over the same memory (one warning) and every range is dropped until load falls.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from radixkv.model.virtual_kv import MapLimitError, VirtualKV

if TYPE_CHECKING:
    from radixkv.engine.request import Sequence
    from radixkv.model.attention.base import ForwardBatch

log = logging.getLogger(__name__)


class VirtualLayout:
    """Follows the engine's page tables with mappings (one range per running sequence)."""

    def __init__(self, virtual: VirtualKV) -> None:
        self.virtual = virtual
        self.paged_steps = 0  # steps that ran paged because of the mapping limit
        self._warned = False

    def release(self, seq: Sequence) -> None:
        self.virtual.release(id(seq))

    def _limit(self, exc: MapLimitError) -> None:
        self.virtual.release_all()
        self.paged_steps += 1
        if not self._warned:
            self._warned = True
            log.warning("%s: running on the paged layout while the load is this high", exc)

    def before_forward(self, fb: ForwardBatch, seqs: list[Sequence]) -> None:
        """Map the batch's new pages and name each request's range in ``fb``."""
        try:
            for seq in seqs:
                self.virtual.sync(id(seq), seq.pages)
        except MapLimitError as exc:
            self._limit(exc)
            return
        fb.virtual_keys = [id(seq) for seq in seqs]

    def after_step(self, running: list[Sequence]) -> None:
        """Sync every running sequence to its page table; drop ranges of any other."""
        try:
            self.virtual.retain({id(s): s.pages for s in running})
        except MapLimitError as exc:
            self._limit(exc)

    def check_integrity(self, running: list[Sequence]) -> None:
        """Every mapped slot holds a page its running sequence holds (see VirtualKV)."""
        self.virtual.check_integrity({id(s): s.pages for s in running})

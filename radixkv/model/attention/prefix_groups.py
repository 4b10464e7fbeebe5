"""Shared-prefix groups of a step: requests whose page tables start with the same page ids.

Requests admitted from the radix tree share the *same page ids* for their common prefix (a system
prompt, a few-shot block, earlier chat turns). A step's attention can read such a prefix once for
every member instead of once per request (cascade attention); this module finds the groups, for
the torch cascade backend and the native kernel alike.

Invariants of a :class:`PrefixGroup` (what the attention backends rely on):

- ``shared`` is a whole number of pages, at least ``min_tokens``, and at most every member's
  cached prefix (``prefix_lens``), so every new token of a member sees all of it (no mask);
- every member's page table starts with the same ``shared // page_size`` page ids;
- a request is in at most one group, every group has at least two members, and only requests
  with new tokens (``0 < extend_lens <= max_extend``) are members.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixkv.cache.prefix import common_prefix_len

__all__ = ["PrefixGroup", "shared_prefix_groups"]


@dataclass(frozen=True)
class PrefixGroup:
    """Requests (indices into the batch) sharing their first ``shared`` tokens' pages."""

    members: list[int]
    shared: int  # tokens, a multiple of the page size


def shared_prefix_groups(
    pages: list[list[int]],
    prefix_lens: list[int],
    extend_lens: list[int],
    page_size: int,
    min_tokens: int,
    max_extend: int | None = None,
) -> list[PrefixGroup]:
    """The groups of requests whose leading pages are the same ids (see the module invariants).

    Args:
        pages: each request's page ids (at least its cached prefix's pages).
        prefix_lens: tokens already cached, per request.
        extend_lens: new tokens, per request.
        page_size: tokens per page.
        min_tokens: shorter shared prefixes are not grouped (the split would cost more than it
            saves).
        max_extend: requests with more new tokens are not grouped (``None``: no limit): their
            own rows already fill the kernel's tiles, and splitting them costs more than reading
            the prefix once saves.
    """
    by_first: dict[int, list[int]] = {}
    for i, (prefix, ext) in enumerate(zip(prefix_lens, extend_lens)):
        short = max_extend is None or ext <= max_extend
        if prefix >= max(min_tokens, page_size) and ext > 0 and short:
            by_first.setdefault(pages[i][0], []).append(i)
    groups = []
    for members in by_first.values():
        if len(members) < 2:
            continue
        ref = pages[members[0]]
        s = min(prefix_lens[i] // page_size for i in members)
        for i in members[1:]:
            s = min(s, common_prefix_len(ref, pages[i]))
        if s > 0 and s * page_size >= min_tokens:
            groups.append(PrefixGroup(members, s * page_size))
    return groups

"""Longest common prefix of two token lists, the comparison every prefix structure needs."""

from __future__ import annotations


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b``.

    Compares slices (in C) with a binary search, so it costs O(log n) slice comparisons instead of
    a Python loop over tokens.
    """
    hi = min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    lo = 0  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo

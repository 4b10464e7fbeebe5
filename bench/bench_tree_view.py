"""Latency of the dashboard's tree snapshot on a big tree (simulation mode, no model, no torch).

    python -m bench.bench_tree_view                 # 100,000 nodes, max_nodes=500
    python -m bench.bench_tree_view --nodes 20000 --max-nodes 200 --page-size 16

Builds a :class:`~radixkv.cache.radix_tree.RadixTree` without an allocator (page ids are fake)
holding at least ``--nodes`` nodes: a few shared "system prompts" under which random branches
fork at random depths (every insert adds a leaf and usually splits an edge), with a third of the
requests under salts and some nodes locked and pinned. Then it times ``tree_view(tree,
max_nodes=...)`` (best and median of ``--repeats``) and its ``json.dumps``, which is what
``GET /cache/tree`` does on the engine thread and the event loop, in wall and CPU time. Target:
< 200 ms at 100,000 nodes and ``max_nodes=500``. The snapshot reads the subtree counts every node
keeps, so its cost follows the shown nodes and their children, not the tree.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence

from radixkv.cache.radix_tree import RadixTree
from radixkv.cache.tree_view import tree_view


def build_tree(num_nodes: int, page_size: int = 1, seed: int = 0) -> RadixTree:
    """A tree of >= ``num_nodes`` nodes (root excluded) built by inserts and matches."""
    rng = random.Random(seed)
    P = page_size
    tree = RadixTree(None, P, "lru")
    systems = [[rng.randrange(1000, 50000) for _ in range(512 * P)] for _ in range(8)]
    seqs: list[tuple[list[int], str | None]] = []
    page = 0
    i = 0
    while True:
        i += 1
        salt = None if i % 3 else f"tenant-{i % 7}"
        if seqs and rng.random() < 0.9:
            base, salt = seqs[rng.randrange(len(seqs))]
            cut = rng.randrange(1, len(base) // P) * P
            tokens = base[:cut]
        else:
            tokens = list(systems[rng.randrange(len(systems))])
        tokens = tokens + [rng.randrange(1000, 50000) for _ in range(rng.randrange(1, 24) * P)]
        tree.match_prefix(tokens, salt)
        n = len(tokens) // P
        tree.insert(tokens, list(range(page, page + n)), salt)
        page += n
        seqs.append((tokens, salt))
        if i % 997 == 0:
            tree.lock(tree.match_prefix(tokens, salt).node)
        if i % 1999 == 0:
            tree.pin(tokens[: len(tokens) // 2], salt)
        if i % 5000 == 0 and tree.num_nodes() >= num_nodes:
            break
    return tree


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=100_000)
    ap.add_argument("--max-nodes", type=int, default=500)
    ap.add_argument("--min-tokens", type=int, default=0)
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)

    t = time.perf_counter()
    tree = build_tree(args.nodes, args.page_size)
    print(
        f"tree: {tree.num_nodes()} nodes, {tree.total_size} tokens, page size {args.page_size} "
        f"(built in {time.perf_counter() - t:.1f}s)"
    )

    def decode(ids: Sequence[int]) -> str:
        return " ".join(f"w{t}" for t in ids)

    snap, ser, cpu = [], [], []
    doc: dict = {}
    for _ in range(args.repeats):
        c0 = time.process_time()
        t0 = time.perf_counter()
        doc = tree_view(tree, max_nodes=args.max_nodes, min_tokens=args.min_tokens, decode=decode)
        t1 = time.perf_counter()
        body = json.dumps(doc)
        t2 = time.perf_counter()
        cpu.append(time.process_time() - c0)
        snap.append(t1 - t0)
        ser.append(t2 - t1)
    total = [a + b for a, b in zip(snap, ser)]
    print(
        f"tree_view(max_nodes={args.max_nodes}): {len(doc['nodes'])} entries "
        f"({doc['shown_nodes']} shown nodes), {len(body) / 1024:.0f} KiB of JSON"
    )
    print(
        f"snapshot ms: best {min(snap) * 1e3:.1f}  median {statistics.median(snap) * 1e3:.1f}; "
        f"json.dumps ms: best {min(ser) * 1e3:.1f}; "
        f"total ms: best {min(total) * 1e3:.1f}  median {statistics.median(total) * 1e3:.1f}"
    )
    print(
        f"CPU ms (snapshot + json, this process): best {min(cpu) * 1e3:.1f}  "
        f"median {statistics.median(cpu) * 1e3:.1f}  (wall > CPU when the host is loaded; "
        f"load average {os.getloadavg()[0]:.1f})"
    )
    ok = statistics.median(total) < 0.2
    print(f"target < 200 ms (median total): {'met' if ok else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

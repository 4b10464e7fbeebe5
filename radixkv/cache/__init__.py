"""The prefix store: block allocator, radix tree (eviction index, pins, host residency) and the
offload tiers beneath it (host pool, disk store).

Owns page ids and which prefix they hold, never model math. Pure Python over integer page ids
(the host pool touches torch tensors only when it is given a KV pool), so the tree can be tested,
simulated and benchmarked without torch. May import: ``radixkv.config`` and itself; never
``radixkv.model``, ``radixkv.engine``, ``radixkv.server`` or ``radixkv.sim``: the device KV pool is
a :class:`~radixkv.cache.page_pool.PagePool`, a protocol the model's ``KVPool`` implements.
"""

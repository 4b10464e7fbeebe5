"""The engine: requests and their sampling, the continuous-batching scheduler, page ownership
between the radix tree and running sequences (KV manager), detokenization, and ``Engine`` itself.

May import: ``radixkv.config``, ``radixkv.cache``, ``radixkv.model`` and itself; never
``radixkv.server`` or ``radixkv.cli``.
"""

"""Workload generators and the hit-rate simulator: replay a trace against the real radix tree and
tiers in bookkeeping-only mode (no KV data, no torch).

May import: ``radixkv.config``, ``radixkv.cache`` and itself.
"""

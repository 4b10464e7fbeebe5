"""The model: weight loading, the Llama forward pass over a paged KV pool, the model runner,
attention backends and radixkv's native CPU kernels (``csrc/``).

Computes logits for a batch described by a ForwardBatch; knows nothing of requests or
scheduling. May import: ``radixkv.config``, ``radixkv.cache`` (prefix helpers), ``radixkv.kernels``
and itself; never ``radixkv.engine``, ``radixkv.server`` or ``radixkv.sim``.
"""

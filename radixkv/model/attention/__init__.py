"""Attention backends over the paged KV pool.

``base`` declares the interface (ForwardBatch, AttentionBackend); ``torch_backend`` (float32,
transformers-faithful), ``native_backend`` (radixkv's C++ kernels), ``cascade_backend``
(shared-prefix cascade over ATen) and ``triton_backend`` (GPUs) implement it; ``factory`` picks one.
Backends import ``base`` only, never each other or the factory.
"""

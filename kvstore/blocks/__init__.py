"""The block vocabulary: what workers, the index and routers all speak.

Chained block keys and their hashing, KV events, the request / output / error types a
router and a worker exchange, and the one quantile rule. This is
the ground layer: it imports nothing else from the project (``tests/test_layers.py``).
"""

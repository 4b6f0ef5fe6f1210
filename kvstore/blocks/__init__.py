"""The block vocabulary: what workers, the index and routers say about KV blocks.

Chained block keys and their hashing (``hashing.py``), KV events (``events.py``) and the KV
tiers (``tiers.py``). It imports nothing of the project but the process runtime
(``tests/test_layers.py``).
"""

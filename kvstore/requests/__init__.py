"""The request vocabulary: what a router and a worker exchange about requests.

Sampling parameters and their hard limits (``sampling_params.py``), a request's output
constraint (``output_constraint.py``), the worker<->router messages (``protocol.py``) and how
they cross process boundaries (``wire.py``), the engine's outputs (``outputs.py``), the typed
errors a caller can act on (``errors.py``), the one check of a request against a model's limits
(``model_limits.py``) and JSON from clients bounded before it is parsed (``json_text.py``).
Built on the block vocabulary; imports no index, engine or router code.
"""

"""Paged attention backends, chosen by name.

* ``torch`` — the reference: plain torch, CPU and CUDA, any ``block_size``. Gathers K/V through
  the block table; exact, not fast.
* ``triton`` — a Triton paged-attention kernel for CUDA (see ``triton_backend`` for why it is
  not ``vllm-flash-attn``). Needs CUDA, the ``triton`` package (shipped with CUDA builds of
  torch; the ``gpu`` extra), and a power-of-two ``block_size`` in [16, 256].
"""

from worker.attention import torch_backend, triton_backend  # noqa: F401 (register backends)
from worker.attention.base import AttentionBackend, AttentionMetadata, write_kv
from worker.attention.registry import (
    BackendUnavailableError,
    UnknownBackendError,
    available_backends,
    backend_names,
    create_backend,
    get_backend_class,
    register_backend,
)

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "BackendUnavailableError",
    "UnknownBackendError",
    "available_backends",
    "backend_names",
    "create_backend",
    "get_backend_class",
    "register_backend",
    "write_kv",
]

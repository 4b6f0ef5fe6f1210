"""Paged attention backends, chosen by name.

* ``torch`` — the reference: plain torch, CPU and CUDA, any ``block_size``. Gathers K/V through
  the block table; exact, not fast.
* ``cpu`` — the torch backend with decodes run by a native C kernel that reads K/V in place
  through the block table (float32; needs a C compiler at first use, see ``native``).
* ``triton`` — a Triton paged-attention kernel for CUDA (see ``triton_backend`` for why it is
  not ``vllm-flash-attn``). Needs CUDA, the ``triton`` package (shipped with CUDA builds of
  torch; the ``gpu`` extra), and a power-of-two ``block_size`` in [16, 256].
* ``flashinfer`` — FlashInfer's paged prefill/append kernel on the same block tables (CUDA,
  ``pip install kvcluster[flashinfer]``, float16/bfloat16, no decode graphs; see
  ``flashinfer_backend``). Chosen by name only until measured against ``triton`` on a GPU.
* ``auto`` — ``triton`` on CUDA, ``cpu`` on the CPU, whichever is usable, else ``torch``.
"""

from worker.attention import (  # noqa: F401 (register backends)
    cpu_backend,
    flashinfer_backend,
    torch_backend,
    triton_backend,
)
from worker.attention.backend_registry import (
    BackendUnavailableError,
    UnknownBackendError,
    available_backends,
    backend_names,
    create_backend,
    get_backend_class,
    register_backend,
    resolve_backend_name,
)
from worker.attention.base import AttentionBackend, AttentionMetadata, write_kv

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
    "resolve_backend_name",
    "write_kv",
]

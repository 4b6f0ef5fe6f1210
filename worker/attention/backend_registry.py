"""Attention backends by name."""

from __future__ import annotations

import torch

from kvstore.blocks.hashing import DEFAULT_BLOCK_SIZE
from kvstore.runtime.registry import Registry
from worker.attention.base import AttentionBackend


class UnknownBackendError(ValueError):
    """No backend of that name is registered."""


class BackendUnavailableError(RuntimeError):
    """The backend exists but cannot run here (no CUDA, no Triton, unsupported block size)."""


BACKENDS: Registry[type[AttentionBackend]] = Registry("attention backend", UnknownBackendError)
register_backend = BACKENDS.register
backend_names = BACKENDS.names  # all registered names, usable here or not


def get_backend_class(name: str) -> type[AttentionBackend]:
    return BACKENDS.get(name, also_valid=[AUTO])


def available_backends(
    device: str | torch.device, block_size: int = DEFAULT_BLOCK_SIZE
) -> list[str]:
    """Names of the backends that can run on ``device`` with ``block_size``."""
    dev = torch.device(device)
    usable = [n for n, c in BACKENDS.items() if c.unavailable_reason(dev, block_size) is None]
    return sorted(usable)


AUTO = "auto"
_PREFERENCE = {"cuda": ("triton", "torch"), "cpu": ("cpu", "torch")}


def resolve_backend_name(
    name: str, device: str | torch.device, block_size: int = DEFAULT_BLOCK_SIZE
) -> str:
    """``name`` itself, or for ``auto`` the fastest backend usable here (``triton`` on CUDA,
    the native ``cpu`` kernels on the CPU, else the ``torch`` reference)."""
    if name != AUTO:
        return name
    dev = torch.device(device)
    for candidate in _PREFERENCE.get(dev.type, ("torch",)):
        if candidate in BACKENDS and (
            BACKENDS.get(candidate).unavailable_reason(dev, block_size) is None
        ):
            return candidate
    return "torch"


def create_backend(
    name: str,
    *,
    device: str | torch.device,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
) -> AttentionBackend:
    name = resolve_backend_name(name, device, block_size)
    cls = get_backend_class(name)
    reason = cls.unavailable_reason(torch.device(device), block_size)
    if reason is not None:
        raise BackendUnavailableError(
            f"attention backend {name!r} cannot run on {device} with block_size={block_size}: "
            f"{reason}; usable here: {', '.join(available_backends(device, block_size))}"
        )
    return cls(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, scale=scale)

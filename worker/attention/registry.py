"""Attention backends by name."""

from __future__ import annotations

import torch

from worker.attention.base import AttentionBackend

_BACKENDS: dict[str, type[AttentionBackend]] = {}


class UnknownBackendError(ValueError):
    """No backend of that name is registered."""


class BackendUnavailableError(RuntimeError):
    """The backend exists but cannot run here (no CUDA, no Triton, unsupported block size)."""


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    """Class decorator: make ``cls`` selectable as ``cls.name``."""
    assert cls.name not in _BACKENDS, f"attention backend {cls.name!r} registered twice"
    _BACKENDS[cls.name] = cls
    return cls


def backend_names() -> list[str]:
    """All registered names, usable here or not."""
    return sorted(_BACKENDS)


def get_backend_class(name: str) -> type[AttentionBackend]:
    try:
        return _BACKENDS[name]
    except KeyError:
        raise UnknownBackendError(
            f"unknown attention backend {name!r}; valid names: "
            f"{', '.join([AUTO, *backend_names()])}"
        ) from None


def available_backends(device: str | torch.device, block_size: int = 16) -> list[str]:
    """Names of the backends that can run on ``device`` with ``block_size``."""
    dev = torch.device(device)
    usable = [n for n, c in _BACKENDS.items() if c.unavailable_reason(dev, block_size) is None]
    return sorted(usable)


AUTO = "auto"
_PREFERENCE = {"cuda": ("triton", "torch"), "cpu": ("cpu", "torch")}


def resolve_backend_name(name: str, device: str | torch.device, block_size: int = 16) -> str:
    """``name`` itself, or for ``auto`` the fastest backend usable here (``triton`` on CUDA,
    the native ``cpu`` kernels on the CPU, else the ``torch`` reference)."""
    if name != AUTO:
        return name
    dev = torch.device(device)
    for candidate in _PREFERENCE.get(dev.type, ("torch",)):
        cls = _BACKENDS.get(candidate)
        if cls is not None and cls.unavailable_reason(dev, block_size) is None:
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

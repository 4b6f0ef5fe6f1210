"""The sampler's copies between the host and the logits' device: small per-row parameter
lists over in one non-blocking copy, results back with one synchronisation (pinned memory on
CUDA)."""

from __future__ import annotations

import torch


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on ``device`` in one (non-blocking, pinned on CUDA) copy."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Device tensors on the host with one synchronisation (pinned buffers on CUDA)."""
    if all(t.device.type == "cpu" for t in tensors):
        return list(tensors)
    out = []
    for t in tensors:
        buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        buf.copy_(t, non_blocking=True)
        out.append(buf)
    torch.cuda.current_stream(tensors[0].device).synchronize()
    return out

"""The host KV tier's tensors and the copies between them and the device KV cache.

On the CPU (and any device but CUDA) every copy is a plain synchronous gather/scatter.

On CUDA the host tier is pinned, and the copies overlap other work instead of serialising
with it; every ordering below is made by a stream or an event. The CPU waits only when a load
reads a host block whose offload is still in flight (it lands that offload first). The
forward waits for a step's whole load (not layer by layer):

- **Load** (host -> device, ``load``): per layer, the CPU gathers the host blocks into a
  pinned staging buffer and issues its DMA to a device buffer on a side stream (the CPU's
  gather of layer l+1 overlaps layer l's DMA, and the DMAs overlap the work still queued on
  the compute stream). The compute stream then waits on the side stream's event before it
  scatters the device buffer into the KV cache, so that scatter and everything enqueued
  after it (copy-on-write copies, the forward) see the loaded blocks, while everything
  enqueued before it (earlier steps still reading the destination blocks' old contents)
  runs first.
- **Offload** (device -> host, ``offload``): the gather of the evicted device blocks runs on
  the compute stream, so it reads them after every earlier write and before any later one:
  the KV manager may hand the blocks out again at once. The DMA of the gathered copy to a
  pinned staging buffer runs on the side stream and overlaps the step's forward; the CPU
  scatters it into the host tier only once its event has completed: lazily, before a load
  reads one of those host blocks, or on ``flush``.

Memory lifetimes: a device buffer made on one stream and used on the other is marked with
``record_stream`` so the caching allocator does not hand its memory out before that use
completes; pinned staging buffers are held (with their event) until the event has completed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

KVPair = tuple[torch.Tensor, torch.Tensor]  # one layer's (K, V)


@dataclass(slots=True)
class _PendingOffload:
    """An offload whose DMA may still be in flight."""

    done: torch.cuda.Event  # recorded on the side stream after the last layer's DMA
    staging: list[KVPair]  # per layer, pinned copies of the gathered blocks
    host: torch.Tensor  # host block ids they go to (CPU, long)
    blocks: frozenset[int]  # the same ids, for overlap checks


class HostKVCache:
    """Per layer, K and V of ``num_blocks`` host blocks (the device cache's block layout).

    Caller's obligations: device block and host block ids are valid and distinct within one
    call (the runner checks); on CUDA, ``load`` and ``offload`` are called from the thread
    that runs the model on the current stream, and ``flush`` before reading ``caches``.
    """

    def __init__(
        self,
        num_blocks: int,
        block_shape: Sequence[int],
        num_layers: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        shape = (num_blocks, *block_shape)
        self.caches: list[KVPair] = [
            (
                torch.zeros(shape, dtype=dtype, pin_memory=self.cuda),
                torch.zeros(shape, dtype=dtype, pin_memory=self.cuda),
            )
            for _ in range(num_layers if num_blocks else 0)
        ]
        self._side = torch.cuda.Stream(self.device) if self.cuda and num_blocks else None
        self._offloads: deque[_PendingOffload] = deque()  # FIFO: later ones overwrite earlier
        self._loads: deque[tuple[torch.cuda.Event, list[KVPair]]] = deque()  # pinned sources

    # ---- device -> host --------------------------------------------------------------------

    def offload(
        self, device_caches: Sequence[KVPair], dev: torch.Tensor, host: torch.Tensor
    ) -> None:
        """Copy device blocks ``dev`` of every layer into host blocks ``host`` (CPU long ids,
        same length)."""
        if not self.cuda:
            dev = dev.to(self.device)
            for (k, v), (hk, hv) in zip(device_caches, self.caches, strict=True):
                hk.index_copy_(0, host, k.index_select(0, dev).cpu())
                hv.index_copy_(0, host, v.index_select(0, dev).cpu())
            return
        self._reap()
        assert self._side is not None
        compute = torch.cuda.current_stream(self.device)
        dev = dev.to(self.device, non_blocking=True)
        gathered = [(k.index_select(0, dev), v.index_select(0, dev)) for k, v in device_caches]
        self._side.wait_stream(compute)  # the gathers above are done before the DMA reads them
        staging: list[KVPair] = []
        with torch.cuda.stream(self._side):
            for gk, gv in gathered:
                pair = []
                for g in (gk, gv):
                    pinned = torch.empty(g.shape, dtype=g.dtype, pin_memory=True)
                    pinned.copy_(g, non_blocking=True)
                    g.record_stream(self._side)  # made on the compute stream, read here
                    pair.append(pinned)
                staging.append((pair[0], pair[1]))
            done = torch.cuda.Event()
            done.record(self._side)
        self._offloads.append(_PendingOffload(done, staging, host, frozenset(host.tolist())))

    def _land(self, upto: int) -> None:
        """Scatter the first ``upto`` pending offloads into the host tier, in order (the CPU
        waits for each one's DMA)."""
        for _ in range(upto):
            p = self._offloads.popleft()
            p.done.synchronize()
            for (sk, sv), (hk, hv) in zip(p.staging, self.caches, strict=True):
                hk.index_copy_(0, p.host, sk)
                hv.index_copy_(0, p.host, sv)

    # ---- host -> device --------------------------------------------------------------------

    def load(self, device_caches: Sequence[KVPair], host: torch.Tensor, dev: torch.Tensor) -> None:
        """Copy host blocks ``host`` of every layer into device blocks ``dev`` (CPU long ids,
        same length); on CUDA the device cache is written in stream order on the compute
        stream (see the module docstring)."""
        if not self.cuda:
            dev = dev.to(self.device)
            for (k, v), (hk, hv) in zip(device_caches, self.caches, strict=True):
                k.index_copy_(0, dev, hk.index_select(0, host).to(self.device))
                v.index_copy_(0, dev, hv.index_select(0, host).to(self.device))
            return
        self._reap()
        wanted = set(host.tolist())
        last = max((i + 1 for i, p in enumerate(self._offloads) if p.blocks & wanted), default=0)
        self._land(last)  # an offload still in flight to a block we read lands first
        assert self._side is not None
        compute = torch.cuda.current_stream(self.device)
        staging: list[KVPair] = []
        moved: list[KVPair] = []
        with torch.cuda.stream(self._side):
            for hk, hv in self.caches:
                pair, out = [], []
                for h in (hk, hv):
                    pinned = torch.empty((len(host), *h.shape[1:]), dtype=h.dtype, pin_memory=True)
                    torch.index_select(h, 0, host, out=pinned)  # CPU gather, before the DMA
                    out.append(pinned.to(self.device, non_blocking=True))  # made on side
                    pair.append(pinned)
                staging.append((pair[0], pair[1]))
                moved.append((out[0], out[1]))
            done = torch.cuda.Event()
            done.record(self._side)
        compute.wait_event(done)  # GPU-side wait: the CPU goes on enqueuing
        dev = dev.to(self.device, non_blocking=True)
        for (k, v), (mk, mv) in zip(device_caches, moved, strict=True):
            mk.record_stream(compute)  # made on the side stream, read here
            mv.record_stream(compute)
            k.index_copy_(0, dev, mk)
            v.index_copy_(0, dev, mv)
        self._loads.append((done, staging))

    # ---- bookkeeping -----------------------------------------------------------------------

    def _reap(self) -> None:
        """Drop pinned load sources whose DMA finished; land finished offloads (no waiting)."""
        while self._loads and self._loads[0][0].query():
            self._loads.popleft()
        ready = 0
        for p in self._offloads:
            if not p.done.query():
                break
            ready += 1
        self._land(ready)

    def flush(self) -> None:
        """Wait for every copy in flight; afterwards ``caches`` holds every offloaded block."""
        self._land(len(self._offloads))
        while self._loads:
            self._loads.popleft()[0].synchronize()

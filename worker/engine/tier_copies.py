"""Runs a batch of the KV manager's copies between tiers through the executor, in the order
:class:`~worker.kv.types.TierTransfers` documents.

Device and host blocks are the executor's tensors; a tier that holds its own bytes (the disk
tier, ``TierBackend.holds_bytes``) gets the KV of the blocks it takes as rows in the canonical
run layout (``worker/model/kv_run.py``) and hands back the rows of the blocks it loads:

1. ``moves`` (host -> a lower tier): read the host blocks before phase 2 overwrites them;
2. ``stores`` (device -> a lower tier) read the evicted device blocks before phase 3 writes
   fresh ones into them; then the executor's ``swap``: ``to_host``, then ``to_device``;
3. ``loads`` (a lower tier -> device): write the tier's rows into the fresh device blocks.

:func:`disk_tier_specs` builds the disk tier the engine's config asks for.
"""

from __future__ import annotations

import zlib

import numpy as np

from kvstore.blocks.tiers import Tier
from worker.engine.config import EngineConfig
from worker.engine.executor import ModelExecutor
from worker.kv import TierSpec, TierTransfers
from worker.kv.disk_format import fingerprint_of
from worker.kv.disk_store import DiskKVStore
from worker.kv.tier_chain import TierChain
from worker.kv.types import TierCopy
from worker.model.kv_run import KVPayload, run_block_bytes


def run_tier_copies(executor: ModelExecutor, tiers: TierChain, transfers: TierTransfers) -> None:
    """Run every copy of ``transfers`` (see the module docstring for the order)."""
    if transfers.moves:
        _hand_down(executor, tiers, transfers.moves)
    if transfers.stores:
        _hand_down(executor, tiers, transfers.stores)
    if transfers.to_host or transfers.to_device:
        executor.swap(transfers)
    by_tier: dict[Tier, list[TierCopy]] = {}
    for copy in transfers.loads:
        by_tier.setdefault(copy[0], []).append(copy)
    for tier, copies in by_tier.items():
        backend = tiers.get(tier)
        assert backend is not None and backend.holds_bytes, f"no bytes to load from {tier}"
        rows = np.ascontiguousarray(backend.loaded_blocks([c[1] for c in copies]))
        layout = executor.kv_layout
        assert layout is not None
        data = rows.reshape(len(copies), layout.num_layers, 2, -1)
        payload = KVPayload(data, zlib.crc32(data))
        executor.write_run(False, [c[3] for c in copies], payload, 0)


def _hand_down(executor: ModelExecutor, tiers: TierChain, copies: list[TierCopy]) -> None:
    """Read the source blocks of ``copies`` (device or host) and hand their KV to the
    destination tiers, one read per source tier and destination."""
    groups: dict[tuple[Tier, Tier], list[TierCopy]] = {}
    for copy in copies:
        groups.setdefault((copy[0], copy[2]), []).append(copy)
    for (src, dst), group in groups.items():
        backend = tiers.get(dst)
        assert backend is not None and backend.holds_bytes, f"no bytes to store into {dst}"
        ids = [c[1] for c in group]
        if src is Tier.DEVICE:
            payload = executor.read_run(ids, [])
        else:
            assert src is Tier.HOST, f"copies out of {src} are not supported"
            payload = executor.read_run([], ids)
        data = payload.data  # type: ignore[attr-defined]
        backend.write_blocks([c[3] for c in group], data.reshape(len(group), -1))


def disk_tier_specs(config: EngineConfig, executor: ModelExecutor, model_id: str) -> list[TierSpec]:
    """The lower tiers below the host tier that ``config`` asks for: the disk tier on its
    store (opened here: the directory is scanned and verified), or none."""
    if not config.disk_kv_bytes or not executor.num_host_blocks:
        return []
    layout = executor.kv_layout
    if layout is None:
        raise ValueError(
            f"disk_kv_bytes={config.disk_kv_bytes}: {type(executor).__name__} holds its KV in "
            "no exchangeable layout, so it cannot be written to disk; set disk_kv_bytes to 0"
        )
    block_bytes = run_block_bytes(layout)
    store = DiskKVStore(
        config.disk_kv_path,
        config.disk_kv_bytes,
        fingerprint=fingerprint_of(model_id, layout),
        block_bytes=block_bytes,
        admit_after=config.disk_kv_admit_after,
    )
    return [TierSpec("disk", max(1, config.disk_kv_bytes // block_bytes), {"store": store})]

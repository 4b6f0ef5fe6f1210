"""Export and import of block runs at the engine: a prompt's prefix computed by another
worker, instead of computed here.

Both functions touch the engine's state and must run between steps, in the engine's thread
or under the engine loop's lock (``EngineLoop.call``); neither blocks on anything but
memory copies. The transport (Ray's object store or another) is the caller's.

- :func:`export_run`: the leading run of the asked keys this engine holds, copied out as a
  :class:`BlockRun`; the source blocks are pinned only during the copy.
- :func:`import_run`: checks the run — fingerprint (layout; model, adapter, salt), every
  block's key and token ids against the prompt, the payload's shape and checksum — before
  using a byte (:class:`ImportRefused` otherwise), writes the blocks this engine lacks into
  its device cache or host tier, and caches them. A request for the prompt added next
  finds them as a prefix hit; their ``BlockStored`` events go out with the next step's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.blocks.hashing import BlockKey, HashContext, block_keys
from kvstore.blocks.tiers import Tier
from worker.engine.engine import Engine
from worker.kv.transfer import BlockRun, ImportRefused, RunHeader, check_header


@dataclass(frozen=True, slots=True)
class ImportResult:
    """What an import did."""

    blocks: int  # blocks written and cached here (0: nothing new)
    tier: str  # where they went: "device" or "host"
    hit_tokens: int  # prompt tokens this engine now holds for the prompt (device + host)


def export_run(
    engine: Engine, keys: Sequence[BlockKey], ctx: HashContext, start: int = 0
) -> BlockRun | None:
    """The leading run of ``keys`` (blocks ``start..`` of a prompt under ``ctx``) this engine
    holds, copied out; None when it holds none of them (or cannot export)."""
    layout = engine.executor.kv_layout
    if layout is None or not keys:
        return None
    pin = engine.kv.pin_export(keys, ctx, start)
    try:
        if not pin.keys:
            return None
        payload = engine.executor.read_run(pin.device_ids, pin.host_ids)
    finally:
        engine.kv.release_export(pin)
    header = RunHeader(layout, ctx, start, tuple(pin.keys), tuple(pin.token_ids))
    return BlockRun(header, payload)


def import_run(
    engine: Engine,
    run: object,
    token_ids: Sequence[int],
    ctx: HashContext,
    keys: Sequence[BlockKey] | None = None,
    *,
    tier: str | None = None,
) -> ImportResult:
    """Check ``run`` against the prompt and write what it adds (see the module docstring).
    ``keys``: the prompt's chained keys under ``ctx`` if the caller has them. Raises
    :class:`ImportRefused` (nothing written) for a run that is not this prompt's."""
    layout = engine.executor.kv_layout
    if layout is None:
        raise ImportRefused(f"{type(engine.executor).__name__} cannot import KV")
    if not isinstance(run, BlockRun):
        raise ImportRefused(f"not a block run: {type(run).__name__}")
    if keys is None:
        keys = block_keys(token_ids, engine.config.block_size, ctx)
    header = check_header(run.header, layout, ctx, token_ids, keys)
    payload = engine.executor.check_run(run.payload, len(header))
    kv = engine.kv
    plan = kv.plan_import(token_ids, ctx, header, tier)
    if plan.block_ids:
        try:
            transfers = kv.take_transfers()  # offloads of blocks the plan evicted: first
            if transfers:
                engine.executor.swap(transfers)
            engine.executor.write_run(plan.tier == Tier.HOST, plan.block_ids, payload, plan.offset)
        except BaseException:
            kv.abort_import(plan)
            raise
        kv.commit_import(plan)
    hit = kv.lookup_prefix(token_ids, ctx, keys)
    return ImportResult(len(plan), plan.tier, hit.num_tokens)

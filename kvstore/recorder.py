"""KV events as the index sees them, and the recorder that samples every k-th block key.

Events are the block vocabulary's (:mod:`kvstore.blocks.events`), as the KV manager emits them.

A :class:`Recorder` turns events into :class:`Op` s on the keys the index records. With
``record_every == 1`` that is every key. With ``k > 1`` it records the key of block ``j`` only
when ``(j + 1) % k == 0``: since keys are chained, holding that key means holding blocks
``0..j``, so a lookup stays exact at multiples of ``k``. Events do not carry block positions,
so the recorder derives them from ``parent`` (``None`` is block 0) and remembers the position
of every cached key of its worker (one dict entry per cached block). A stored key whose parent
it never saw is not recorded (a lookup may under-count, never over-count).

Tiers: a stored or removed event's :class:`~kvstore.blocks.tiers.Tier` becomes its op's tier,
so the index keeps one set of entries per tier; a clear ("C") drops every tier. Positions are
remembered per tier (a key moving between tiers may leave one after it entered the other); a
key's parent may be in any tier.

Recording is idempotent: replaying events already seen yields the same ops and state, so a
caller may retry ``apply_events`` with the same batch after an outage.

Prefix closure: fed every event of a prefix-closed cache, the recorded keys are prefix-closed
too (a key is recorded only under a known parent, and the cache evicts children first). If
events are lost before the recorder sees them, a remembered position may outlive the removal
it missed and later let a key be recorded while its ancestor is not; :meth:`Recorder.forget`
(called by the publisher after such a loss) restores closure, at the price of not recording
the blocks cached before the loss until they are stored again (``k > 1`` only).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Literal, NamedTuple

from kvstore.blocks.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvstore.blocks.hashing import BlockKey
from kvstore.blocks.tiers import HELD_TIERS, Tier

OpKind = Literal["S", "R", "C"]  # stored, removed, all cleared


class Op(NamedTuple):
    """One recorded change: ``("S", keys, tier)`` stored in ``tier``, ``("R", keys, tier)``
    removed from it, ``("C", (), None)`` every tier cleared."""

    kind: OpKind
    keys: tuple[BlockKey, ...]
    tier: Tier | None = Tier.DEVICE


CLEARED = Op("C", (), None)

TierKeys = Mapping[Tier, Iterable[BlockKey]]
"""A worker's cached keys per tier (a resync snapshot); a tier it does not name is empty."""


_KINDS: dict[type, OpKind] = {BlockStored: "S", BlockRemoved: "R", AllBlocksCleared: "C"}


def event_kind(event: object) -> OpKind:
    """``"S"``, ``"R"`` or ``"C"`` for a KV event; ``TypeError`` for anything else."""
    kind = _KINDS.get(type(event))
    if kind is None:
        raise TypeError(
            f"not a KV event: {event!r} (expected BlockStored, BlockRemoved or AllBlocksCleared)"
        )
    return kind


class Recorder:
    """Per-worker conversion of KV events into ops on recorded keys. Not thread-safe."""

    __slots__ = ("record_every", "_pos")

    def __init__(self, record_every: int = 1) -> None:
        assert record_every >= 1
        self.record_every = record_every
        # position of each key, per tier that holds it (k > 1 only)
        self._pos: dict[Tier, dict[BlockKey, int]] = {tier: {} for tier in HELD_TIERS}

    def _recorded_position(self, pos: int | None) -> bool:
        return pos is not None and (pos + 1) % self.record_every == 0

    def record(self, events: Iterable[object]) -> list[Op]:
        ops: list[Op] = []
        k = self.record_every
        for event in events:
            kind = event_kind(event)
            if kind == "C":
                self.forget()
                ops.append(CLEARED)
                continue
            tier = Tier(event.tier)  # type: ignore[attr-defined]
            pos = self._pos[tier]
            keys: Sequence[BlockKey] = event.keys  # type: ignore[attr-defined]
            if k == 1:
                out = tuple(keys)
            elif kind == "S":
                out = self._stored(event.parent, keys, pos)  # type: ignore[attr-defined]
            else:
                # Unknown keys are sent too: they may have been recorded before a replay.
                out = tuple(key for key in keys if pos.pop(key, -1) % k == k - 1)
            if out:
                ops.append(Op(kind, out, tier))
        return ops

    def _stored(
        self, parent: BlockKey | None, keys: Sequence[BlockKey], into: dict[BlockKey, int]
    ) -> tuple[BlockKey, ...]:
        pos: int | None = -1 if parent is None else self._position(parent)
        out = []
        for key in keys:
            pos = None if pos is None else pos + 1
            if pos is None:
                pos = into.get(key)  # parent unknown: keep what a replay already knew
            else:
                into[key] = pos
            if self._recorded_position(pos):
                out.append(key)
        return tuple(out)

    def _position(self, key: BlockKey) -> int | None:
        """The key's position in whichever tier holds it (fastest first), or None."""
        for pos in self._pos.values():
            found = pos.get(key)
            if found is not None:
                return found
        return None

    def forget(self) -> None:
        """Forget every position: only keys stored from now on under a known parent (or as
        block 0) are recorded. For after lost events (see the module docstring)."""
        for pos in self._pos.values():
            pos.clear()

    def recorded(self, keys: Iterable[BlockKey], tier: Tier = Tier.DEVICE) -> list[BlockKey]:
        """The subset of a worker's cached keys in ``tier`` that the index records."""
        if self.record_every == 1:
            return list(keys)
        pos = self._pos[tier]
        return [key for key in keys if self._recorded_position(pos.get(key))]


def sampled(keys: Sequence[BlockKey], record_every: int) -> Sequence[BlockKey]:
    """Keys of a prompt at recorded positions ``k-1, 2k-1, ...``."""
    return keys if record_every == 1 else keys[record_every - 1 :: record_every]

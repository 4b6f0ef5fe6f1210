"""KV events as the index sees them, and the recorder that samples every k-th block key.

Events are the block vocabulary's (:mod:`kvstore.blocks.events`), as the KV manager emits them.

A :class:`Recorder` turns events into :data:`Op` s on the keys the index records. With
``record_every == 1`` that is every key. With ``k > 1`` it records the key of block ``j`` only
when ``(j + 1) % k == 0``: since keys are chained, holding that key means holding blocks
``0..j``, so a lookup stays exact at multiples of ``k``. Events do not carry block positions,
so the recorder derives them from ``parent`` (``None`` is block 0) and remembers the position
of every cached key of its worker (one dict entry per cached block). A stored key whose parent
it never saw is not recorded (a lookup may under-count, never over-count).

Host tier: events with ``tier="host"`` (see :mod:`kvstore.blocks.events`) become ops ``"s"``
(stored in the host tier) and ``"r"`` (removed from it) on a second set of entries; a clear
("C") drops both tiers. Positions are remembered per tier (a key moving between tiers may
leave one after it entered the other); a host key's parent may be in either tier.

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

from collections.abc import Iterable, Sequence
from typing import Literal, NamedTuple

from kvstore.blocks.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvstore.blocks.hashing import BlockKey

OpKind = Literal["S", "R", "s", "r", "C"]  # stored, removed (device; lower case: host), cleared
Op = tuple[OpKind, tuple[BlockKey, ...]]
"""One recorded change: ("S", keys) stored, ("R", keys) removed, ("C", ()) all cleared; "s"
and "r" are the same for the host tier."""


class TierKeys(NamedTuple):
    """A worker's cached keys per tier (a resync snapshot of a worker with a host tier)."""

    device: Sequence[BlockKey]
    host: Sequence[BlockKey]


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

    __slots__ = ("record_every", "_pos", "_hpos")

    def __init__(self, record_every: int = 1) -> None:
        assert record_every >= 1
        self.record_every = record_every
        self._pos: dict[BlockKey, int] = {}  # position of each device key (k > 1 only)
        self._hpos: dict[BlockKey, int] = {}  # position of each host-tier key (k > 1 only)

    def _recorded_position(self, pos: int | None) -> bool:
        return pos is not None and (pos + 1) % self.record_every == 0

    def record(self, events: Iterable[object]) -> list[Op]:
        ops: list[Op] = []
        k = self.record_every
        for event in events:
            kind = event_kind(event)
            if kind == "C":
                self._pos.clear()
                self._hpos.clear()
                ops.append(("C", ()))
                continue
            host = getattr(event, "tier", "device") != "device"
            pos = self._hpos if host else self._pos
            keys: Sequence[BlockKey] = event.keys  # type: ignore[attr-defined]
            if k == 1:
                out = tuple(keys)
            elif kind == "S":
                out = self._stored(event.parent, keys, pos)  # type: ignore[attr-defined]
            else:
                # Unknown keys are sent too: they may have been recorded before a replay.
                out = tuple(key for key in keys if pos.pop(key, -1) % k == k - 1)
            ops.append((kind.lower() if host else kind, out))  # type: ignore[arg-type]
        return [op for op in ops if op[0] == "C" or op[1]]

    def _stored(
        self, parent: BlockKey | None, keys: Sequence[BlockKey], into: dict[BlockKey, int]
    ) -> tuple[BlockKey, ...]:
        if parent is None:
            pos: int | None = -1
        else:
            pos = self._pos.get(parent, self._hpos.get(parent))
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

    def forget(self) -> None:
        """Forget every position: only keys stored from now on under a known parent (or as
        block 0) are recorded. For after lost events (see the module docstring)."""
        self._pos.clear()
        self._hpos.clear()

    def recorded(self, keys: Iterable[BlockKey], *, host: bool = False) -> list[BlockKey]:
        """The subset of a worker's cached keys (of the host tier if ``host``) that the index
        records."""
        if self.record_every == 1:
            return list(keys)
        pos = self._hpos if host else self._pos
        return [key for key in keys if self._recorded_position(pos.get(key))]


def sampled(keys: Sequence[BlockKey], record_every: int) -> Sequence[BlockKey]:
    """Keys of a prompt at recorded positions ``k-1, 2k-1, ...``."""
    return keys if record_every == 1 else keys[record_every - 1 :: record_every]

"""Which prompt prefixes a worker served most, for a new peer's warm start. Pure Python.

A prompt is a shared prefix (a system prompt, a document) plus a tail of its own, so what
is hot is the shared part, not the whole prompt: :class:`ServedPrefixes` counts, per block
key, the requests whose prompt held it (chained keys: a key names its whole prefix), and a
prompt's hot prefix is its leading blocks that another request shared too. Both tables are
bounded, least recent dropped first.

The tables live as long as the worker and fill to thousands of prompts, so they hold no
object the cyclic collector tracks: a prompt is its context's fields and its keys joined into
one ``bytes``, in a tuple of atomic values (which the collector untracks). A full collection
then never scans them, however long the worker has served (a ``HashContext`` and a tuple of
keys per prompt were ~8k tracked objects at the bound).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvstore.blocks.hashing import KEY_BYTES, BlockKey, HashContext


@dataclass(frozen=True, slots=True)
class HotPrefix:
    """A prefix to warm up from: its context, chained keys and how many requests used it."""

    ctx: HashContext
    keys: tuple[BlockKey, ...]
    uses: int


class ServedPrefixes:
    """Prompts served (their full blocks' keys) and the uses of each key; see the module."""

    def __init__(self, max_prompts: int = 4096, max_keys: int = 1 << 16) -> None:
        self.max_prompts = max_prompts
        self.max_keys = max_keys
        # last key of a prompt -> its context's fields and its keys joined (see the module)
        self._prompts: OrderedDict[BlockKey, tuple[str, str | None, str | None, bytes]] = (
            OrderedDict()
        )
        self._uses: OrderedDict[BlockKey, int] = OrderedDict()  # key -> requests that held it

    def note(self, ctx: HashContext, keys: Sequence[BlockKey]) -> None:
        """A request with these full blocks (its prompt's, under ``ctx``) was served."""
        if not keys:
            return
        for key in keys:
            self._uses[key] = self._uses.pop(key, 0) + 1
        while len(self._uses) > self.max_keys:
            self._uses.popitem(last=False)
        last = keys[-1]
        joined = b"".join(keys)
        assert len(joined) == KEY_BYTES * len(keys), "block keys are KEY_BYTES long"
        self._prompts.pop(last, None)
        self._prompts[last] = (ctx.model_id, ctx.lora_id, ctx.cache_salt, joined)
        while len(self._prompts) > self.max_prompts:
            self._prompts.popitem(last=False)

    def hot(self, n: int) -> list[HotPrefix]:
        """The ``n`` prefixes used most (longer, then more recent, first among equals): each
        prompt's leading blocks that at least two requests held, or the whole prompt if
        none were shared."""
        found: dict[BlockKey, tuple[HotPrefix, int]] = {}
        for age, (model_id, lora_id, salt, joined) in enumerate(reversed(self._prompts.values())):
            keys = split_keys(joined)
            shared = 0
            while shared < len(keys) and self._uses.get(keys[shared], 0) >= 2:
                shared += 1
            prefix = keys[:shared] if shared else keys
            end = prefix[-1]
            if end not in found:
                ctx = HashContext(model_id, lora_id, salt)
                found[end] = (HotPrefix(ctx, prefix, max(self._uses.get(end, 0), 1)), age)
        ranked = sorted(found.values(), key=lambda e: (-e[0].uses, -len(e[0].keys), e[1]))
        return [h for h, _ in ranked[: max(n, 0)]]


def split_keys(joined: bytes) -> tuple[BlockKey, ...]:
    """The keys that ``b"".join`` made ``joined`` of."""
    return tuple(BlockKey(joined[i : i + KEY_BYTES]) for i in range(0, len(joined), KEY_BYTES))


def pick_warm(
    offers: Iterable[tuple[str, Sequence[HotPrefix]]], n: int, max_blocks: int
) -> list[tuple[HotPrefix, list[str]]]:
    """From each peer's hot list, the ``n`` prefixes the fleet used most (uses summed over
    peers), each with the peers that offered it (most uses first), within ``max_blocks``
    blocks in all; a prefix that the ones picked before already cover brings only its new
    blocks and is skipped when it brings none."""
    merged: dict[BlockKey, tuple[HotPrefix, dict[str, int]]] = {}
    for peer, hots in offers:
        for h in hots:
            prev = merged.get(h.keys[-1])
            if prev is None:
                merged[h.keys[-1]] = (h, {peer: h.uses})
            else:
                prev[1][peer] = prev[1].get(peer, 0) + h.uses
    ranked = sorted(
        merged.values(), key=lambda e: (-sum(e[1].values()), -len(e[0].keys), e[0].keys[-1])
    )
    picked: list[tuple[HotPrefix, list[str]]] = []
    covered: set[BlockKey] = set()
    budget = max_blocks
    for h, peers in ranked:
        if len(picked) >= n:
            break
        new = [k for k in h.keys if k not in covered]
        if not new or len(new) > budget:
            continue
        budget -= len(new)
        covered.update(new)
        picked.append((h, sorted(peers, key=lambda p: (-peers[p], p))))
    return picked

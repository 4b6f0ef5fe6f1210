"""Forks of a request's sequences, sharing their parent's KV blocks (copy-on-write): the
parallel samples off the prompt's first logits, and the beams off their parents each step.

The KV manager shares the parent's blocks with the fork; a shared block is copied only when
one of them writes into it. The scheduler calls these while applying the output processor's
outcomes (``Scheduler.fork_samples``, ``Scheduler.update_from_output``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from collections.abc import Sequence as Seq

from worker.engine.detokenizer import OutputText
from worker.engine.request import Request, Sequence, sample_generator
from worker.kv import KVCacheManager


def fork_samples(
    kv: KVCacheManager, req: Request, parent: Sequence, texts: Seq[OutputText | None]
) -> list[Sequence]:
    """n > 1: the prompt was computed once, for ``parent``; fork the other samples off it
    before they sample from its logits. ``texts``: each new sample's detokenizer (or
    ``None``)."""
    req.forked = True
    kids = []
    for i, text in enumerate(texts, start=1):
        child = parent.fork(i, sample_generator(req.params.seed, i), text)
        kv.fork(parent.seq_id, child.seq_id)
        req.seqs.append(child)  # at once: an abort frees every forked sequence
        kids.append(child)
    return kids


def advance_beams(
    kv: KVCacheManager,
    req: Request,
    nxt: list[tuple[int, int]],
    free_seq: Callable[[Sequence], None],
) -> None:
    """The new beams, by rank, as (parent beam, token): a parent with no child is pruned
    (``free_seq``: its blocks back at once), one with several is forked."""
    children: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for rank, (parent, tok) in enumerate(nxt):
        children[parent].append((rank, tok))
    new: list[Sequence | None] = [None] * len(nxt)
    for parent, seq in enumerate(req.seqs):
        mine = children.get(parent)
        if not mine:
            free_seq(seq)
            continue
        for rank, tok in mine[1:]:  # fork before the parent appends its own token
            child = seq.fork(rank, None, None)
            kv.fork(seq.seq_id, child.seq_id)
            child.token_ids.append(tok)
            new[rank] = child
        rank, tok = mine[0]
        seq.token_ids.append(tok)
        seq.index = rank
        new[rank] = seq
    req.seqs = [s for s in new if s is not None]

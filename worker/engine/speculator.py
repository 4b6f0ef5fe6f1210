"""Speculative decoding's policy in the engine: which requests speculate, how many draft
tokens each gets, whether speculation pays on this worker at all, and its counters."""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from worker.engine import ngram_proposer, suffix_proposer
from worker.engine.config import SpeculativeConfig
from worker.engine.proposer import CorpusKey, Proposer, create_proposer

if TYPE_CHECKING:
    from worker.engine.request import Request, Sequence

PROPOSER_MODULES = (ngram_proposer, suffix_proposer)  # imported: they register themselves
ALPHA = 0.2  # EWMA weight of the newest sample (acceptance, step throughput)
PROBE_EVERY = 16  # steps: while speculation is off, one step in this many probes it again;
# while on, one in this many runs plain to keep the plain step's measure fresh
MAX_DRAFT_ROWS = 64  # draft tokens in one step at most (all sequences): past the knee of the
# multi-row forward on a CPU, a verify row costs about what a decode row does
PAYS = 0.97  # speculate while its tokens/s is at least this share of a plain step's


@dataclass(slots=True)
class SpecCounters:
    """Counters in vLLM's names (``spec_decode_*``), cumulative."""

    num_drafts: int = 0  # verify chunks (sequences that carried drafts into a step)
    num_draft_tokens: int = 0  # draft tokens verified
    num_accepted_tokens: int = 0  # of those, accepted
    accepted_per_pos: list[int] = field(default_factory=list)  # accepted at draft position i


def eligible(req: Request) -> bool:
    """The request may speculate (see ``SpeculativeConfig``: the features that turn it off)."""
    p = req.params
    return (
        p.n == 1
        and not p.use_beam_search
        and p.seed is None
        and p.logprobs is None
        and req.prompt_logprobs is None
        and not p.has_penalties
        and not p.logit_bias
        and p.min_tokens == 0
        and p.structured is None
    )


class Speculator:
    """Holds the proposer, each request's running acceptance, the measured step throughput
    with and without drafts (EWMAs), and the counters."""

    def __init__(self, config: SpeculativeConfig) -> None:
        assert config.enabled, "no speculator for method none"
        self.config = config
        extra = {"max_corpus_tokens": config.suffix_corpus_tokens}
        self.proposer: Proposer = create_proposer(
            config.method,
            config.prompt_lookup_min,
            config.prompt_lookup_max,
            **(extra if config.method == "suffix" else {}),
        )
        self.counters = SpecCounters(accepted_per_pos=[0] * config.num_speculative_tokens)
        self._accept: dict[str, float] = {}  # request id -> EWMA of accepted drafts per step
        self._rate = {True: 0.0, False: 0.0}  # speculating? -> EWMA tokens/s of decode steps
        self._step = 0
        self._on = True  # speculation pays (or is being probed)
        self._step_drafts = 0  # draft tokens given out in the current step

    # ---- requests ------------------------------------------------------------------------

    def start(self, req: Request) -> None:
        if eligible(req):
            key = CorpusKey(req.params.cache_salt, req.params.lora)
            self.proposer.start(req.request_id, key)
            self._accept[req.request_id] = float(self.config.num_speculative_tokens)

    def finish(self, req: Request) -> None:
        if self._accept.pop(req.request_id, None) is None:
            return
        seqs = (*req.seqs, *req.done_seqs)
        ok = req.error is None and seqs and seqs[0].finish_reason is not None
        self.proposer.finish(req.request_id, seqs[0].token_ids if ok and seqs else None)

    # ---- one step ------------------------------------------------------------------------

    def begin_step(self) -> None:
        self._step += 1
        self._step_drafts = 0

    def speculating(self) -> bool:
        """Whether this step carries drafts: on while it pays, with a probe (or a plain
        step) every ``PROBE_EVERY`` steps."""
        if not self.config.adaptive:
            return True
        probe = self._step % PROBE_EVERY == 0
        return self._on != probe

    def draft(self, req: Request, seq: Sequence, room: int, num_decoding: int) -> list[int]:
        """Draft tokens for ``seq``'s next step, at most ``room``: sized by the request's
        running acceptance and, with ``num_decoding`` sequences decoding, by the step's
        draft-row cap."""
        accept = self._accept.get(req.request_id)
        if accept is None:
            return []
        k = self.config.num_speculative_tokens
        if self.config.adaptive:
            k = min(k, int(math.ceil(accept)) + 1)
            share = max(1, MAX_DRAFT_ROWS // max(1, num_decoding))
            k = min(k, share, MAX_DRAFT_ROWS - self._step_drafts)
        k = min(k, room)
        if k <= 0:
            return []
        drafts = self.proposer.propose(req.request_id, seq.token_ids, k)
        self._step_drafts += len(drafts)
        return drafts

    def verified(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        c = self.counters
        c.num_drafts += 1
        c.num_draft_tokens += num_drafts
        c.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            c.accepted_per_pos[i] += 1
        old = self._accept.get(req.request_id)
        if old is not None:
            self._accept[req.request_id] = (1 - ALPHA) * old + ALPHA * num_accepted

    def end_step(self, speculated: bool, tokens: int, seconds: float) -> None:
        """A decode-only step of ``tokens`` generated in ``seconds`` (with drafts or not):
        update the throughput EWMAs and decide whether speculation pays."""
        if seconds <= 0 or tokens <= 0:
            return
        rate = tokens / seconds
        old = self._rate[speculated]
        self._rate[speculated] = rate if old == 0.0 else (1 - ALPHA) * old + ALPHA * rate
        spec, plain = self._rate[True], self._rate[False]
        if spec and plain:
            self._on = spec >= PAYS * plain

    @property
    def on(self) -> bool:
        """Speculation currently pays (adaptive), or is always on."""
        return self._on or not self.config.adaptive

    def accepted_lengths(self) -> Seq[int]:
        return self.counters.accepted_per_pos

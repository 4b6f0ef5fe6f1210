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
PROBE_EVERY = 16  # steps between probes (a step of the kind not running) at one load:
# while speculation is off, a probe measures it again; while on, a plain step keeps the plain
# measure fresh. Each probe that confirms the choice doubles the gap, up to MAX_PROBE_EVERY:
# a probe of what does not pay costs that step's difference (a verify step at 64 sequences
# on a CPU: +80 %), so a settled load pays it rarely
MAX_PROBE_EVERY = 256
MAX_DRAFT_ROWS = 64  # draft tokens in one step at most (all sequences): past the knee of the
# multi-row forward on a CPU, a verify row costs about what a decode row does
MISSES_TO_PAUSE = 2  # verifies in a row with nothing accepted before a request pauses drafting
MAX_PAUSE = 64  # steps: a paused request's pauses double per further miss, up to this
PAYS = 1.0  # speculate while its tokens/s is at least this share of a plain step's: no
# tolerated loss, since the probes and the first measures already cost a little


@dataclass(slots=True)
class SpecCounters:
    """Counters in vLLM's names (``spec_decode_*``), cumulative."""

    num_drafts: int = 0  # verify chunks (sequences that carried drafts into a step)
    num_draft_tokens: int = 0  # draft tokens verified
    num_accepted_tokens: int = 0  # of those, accepted
    accepted_per_pos: list[int] = field(default_factory=list)  # accepted at draft position i


@dataclass(slots=True)
class Acceptance:
    """One request's running acceptance: the EWMA of drafts accepted per verify (sizes its
    drafts), the verifies in a row that accepted nothing, and the step before which it
    drafts nothing. A request whose drafts keep missing (plain chat: its text is in no
    corpus) pauses for 2, 4, ... ``MAX_PAUSE`` steps, drafting once after each pause: at
    load its verify rows would cost every step about what a decode row does, for nothing."""

    ewma: float
    misses: int = 0
    resume_at: int = 0

    def verified(self, num_accepted: int, step: int) -> None:
        self.ewma = (1 - ALPHA) * self.ewma + ALPHA * num_accepted
        if num_accepted:
            self.misses = 0
            return
        self.misses += 1
        if self.misses >= MISSES_TO_PAUSE:
            self.resume_at = step + 1 + min(MAX_PAUSE, 1 << (self.misses - 1))


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
        and not p.allowed_token_ids
        and not p.bad_words
        and p.min_tokens == 0
        and p.structured is None
    )


def load_level(num_decoding: int) -> int:
    """The class of a step's load: sequences decoding, by power of two (1, 2-3, 4-7, ...)."""
    return max(0, num_decoding).bit_length()


def pays(rates: dict[bool, float]) -> bool:
    """Speculation pays at a load whose measured rates are ``rates`` (unmeasured: yes)."""
    spec, plain = rates.get(True), rates.get(False)
    return spec is None or plain is None or spec >= PAYS * plain


@dataclass(slots=True)
class LoadLevel:
    """What one load level measured: tokens/s of its decode-only steps with drafts and
    without (EWMAs), and when it probes the kind not running next."""

    rates: dict[bool, float] = field(default_factory=dict)  # speculating? -> EWMA tokens/s
    every: int = PROBE_EVERY  # steps between probes now
    last_probe: int | None = None  # the step number of the last probe (or of the choice)

    def choose(self, step: int) -> tuple[bool, bool | None]:
        """(speculate in this step?, the choice a probe checks or None: no probe)."""
        if True not in self.rates or False not in self.rates:
            return True not in self.rates, None  # measure each kind once first
        on = pays(self.rates)
        if self.last_probe is None:  # both just measured: the first probe comes after a gap
            self.last_probe = step
        if step < self.last_probe + self.every:
            return on, None
        self.last_probe = step
        return not on, on

    def measured(self, speculated: bool, rate: float, probed: bool | None) -> None:
        old = self.rates.get(speculated)
        # a probe's measure replaces its kind's, last taken a gap ago: averaged in, one noisy
        # step (another job's burst on a shared machine) would outweigh the fresh probes
        # for several doubling gaps, while the running kind is measured every step
        fresh = old is None or probed is not None
        self.rates[speculated] = rate if fresh else (1 - ALPHA) * old + ALPHA * rate
        if probed is not None:  # a probe: the choice held (probe less) or turned (as often)
            held = pays(self.rates) == probed
            self.every = min(2 * self.every, MAX_PROBE_EVERY) if held else PROBE_EVERY


class Speculator:
    """Holds the proposer, each request's running acceptance, the measured step throughput
    with and without drafts (EWMAs) at each load, and the counters.

    Load: decode steps are compared only with steps of about as many decoding sequences
    (their count's power of two, :func:`load_level`): a verify step's cost relative to a plain
    one grows with the batch (a CPU's multi-row forward is cheap up to a few rows, then grows
    linearly), and a step's throughput at one batch size says nothing of another's. Each
    level measures one step of each kind first, then runs the kind that pays, with a step of
    the other kind now and then (``PROBE_EVERY``, backing off while the choice holds)."""

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
        self._accept: dict[str, Acceptance] = {}  # by request id
        self._levels: dict[int, LoadLevel] = {}  # by load_level()
        self._level = LoadLevel()  # the current step's
        self._probed: bool | None = None  # the choice the current step probes (None: none)
        self._step = 0
        self._step_drafts = 0  # draft tokens given out in the current step

    # ---- requests ------------------------------------------------------------------------

    def start(self, req: Request) -> None:
        if eligible(req):
            key = CorpusKey(req.params.cache_salt, req.params.lora)
            self.proposer.start(req.request_id, key, req.prompt_ids)
            self._accept[req.request_id] = Acceptance(float(self.config.num_speculative_tokens))

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

    def speculating(self, num_decoding: int) -> bool:
        """Whether this step, with ``num_decoding`` sequences decoding, carries drafts: at a
        load not measured yet, one step with and one without; then the kind that pays at
        that load, with a probe of the other kind now and then."""
        self._enter_level(num_decoding)
        if not self.config.adaptive:
            return True
        speculate, self._probed = self._level.choose(self._step)
        return speculate

    def plain_step(self, num_decoding: int) -> None:
        """This step carries no drafts whatever its load's choice (prompts go first): a
        decode-only step of it measures the plain kind at its load, probing nothing."""
        self._enter_level(num_decoding)

    def _enter_level(self, num_decoding: int) -> None:
        """The current step's load level (created at its first step), probing nothing yet."""
        level = load_level(num_decoding)
        self._level = self._levels.get(level) or self._levels.setdefault(level, LoadLevel())
        self._probed = None

    def draft(self, req: Request, seq: Sequence, room: int, num_decoding: int) -> list[int]:
        """Draft tokens for ``seq``'s next step, at most ``room``: sized by the request's
        running acceptance and, with ``num_decoding`` sequences decoding, by the step's
        draft-row cap."""
        accept = self._accept.get(req.request_id)
        if accept is None:
            return []
        k = self.config.num_speculative_tokens
        if self.config.adaptive:
            if self._step < accept.resume_at:
                return []
            k = min(k, int(math.ceil(accept.ewma)) + 1)
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
        accept = self._accept.get(req.request_id)
        if accept is not None:
            accept.verified(num_accepted, self._step)

    def end_step(self, speculated: bool, tokens: int, seconds: float) -> None:
        """A decode-only step of ``tokens`` generated in ``seconds`` (with drafts or not) at
        the current step's load: update that load's measures."""
        if seconds <= 0 or tokens <= 0:
            return
        self._level.measured(speculated, tokens / seconds, self._probed)

    @property
    def on(self) -> bool:
        """Speculation pays at the last step's load (as far as measured), or is always on."""
        return not self.config.adaptive or pays(self._level.rates)

    def accepted_lengths(self) -> Seq[int]:
        return self.counters.accepted_per_pos

"""Requests and their sequences (samples or beams), as the scheduler and the engine see them."""

from __future__ import annotations

import itertools
import time
from concurrent.futures import Future
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch

from kvstore.requests.outputs import CompletionDelta, FinishReason, TokenLogprob, Usage
from kvstore.requests.sampling_params import SamplingParams
from worker.engine.detokenizer import OutputText
from worker.kv import BlockKey, HashContext

if TYPE_CHECKING:
    from worker.engine.beam import BeamSearch
    from worker.model.reasoning_markers import PromptReasoning

_seq_ids = itertools.count()
_SEED_STRIDE = 0x9E3779B97F4A7C15  # odd 64-bit constant: distinct seeds per sample index
_MASK64 = 2**64 - 1


class RequestStatus(Enum):
    WAITING = "waiting"  # never admitted
    RUNNING = "running"  # admitted; its sequences hold (or are acquiring) KV blocks
    PREEMPTED = "preempted"  # blocks freed for recompute; back in the waiting queue
    FINISHED = "finished"  # done, aborted or failed; holds nothing


def sample_generator(seed: int | None, index: int) -> torch.Generator | None:
    """Private RNG of sample ``index`` of a seeded request (``None`` if unseeded); its
    initial seed is the sample's base seed (:meth:`Sequence.seed_draw` derives each
    position's from it)."""
    if seed is None:
        return None
    g = torch.Generator()
    g.manual_seed((seed + index * _SEED_STRIDE) % (2**63))
    return g


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit ints that scatters nearby inputs."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_seed(base: int, position: int) -> int:
    """The seed of a seeded sample's draw at output ``position`` (0: its first token): a
    function of the two alone, so a continuation elsewhere draws what this run would."""
    return _mix64((_mix64(base) + position) & _MASK64) % (2**63)


class Sequence:
    """One token stream of a request: a parallel sample or a beam, with its own block table."""

    __slots__ = (
        "seq_id",
        "index",
        "token_ids",
        "prompt_len",
        "num_computed",
        "allocated",
        "finish_reason",
        "stop_reason",
        "text",
        "generator",
        "seed_base",
        "prior_output",
        "cumulative_logprob",
        "new_tokens",
        "new_logprobs",
        "pending_logits",
        "finish_sent",
        "cached_hint",
        "claim",
        "matcher",
        "held_matcher",
        "spec",
    )

    def __init__(
        self,
        index: int,
        token_ids: list[int],
        prompt_len: int,
        text: OutputText | None,
        generator: torch.Generator | None,
        prior_output: int = 0,
    ) -> None:
        self.seq_id = next(_seq_ids)  # id in the KV manager (unique per process)
        self.index = index  # sample index (0..n-1); beams: rank when created
        self.token_ids = token_ids  # prompt + generated tokens
        self.prompt_len = prompt_len
        self.num_computed = 0  # tokens whose KV is in the cache (or written this step)
        self.allocated = False  # the KV manager knows this sequence
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None
        self.text = text  # detokenizer + stop strings (None for beams: decoded at the end)
        self.generator = generator  # private RNG of a seeded request
        self.seed_base = generator.initial_seed() if generator is not None else None
        # trailing prompt tokens that are this request's own earlier output (a stream moved
        # from a worker that died): seeded draws and penalties count them as output
        self.prior_output = prior_output
        self.cumulative_logprob = 0.0
        self.new_tokens: list[int] = []  # generated but not yet streamed
        self.new_logprobs: list[TokenLogprob] = []  # their logprobs, if requested
        self.pending_logits: torch.Tensor | None = None  # beams: logits waiting for siblings
        self.finish_sent = False  # the delta carrying finish_reason was handed out
        # while waiting: leading prompt tokens it should not compute - cached, or claimed by a
        # sequence queued ahead of it (set on queueing, refreshed at each admission attempt);
        # the load report counts only the rest as queued prefill
        self.cached_hint = 0
        self.claim: list[BlockKey] = []  # while waiting: its full-block keys (Scheduler claims)
        # structured outputs: this sequence's grammar state (an llguidance matcher), advanced
        # by each token it samples; it survives preemption as the output tokens do
        self.matcher: Any = None
        # the matcher kept aside while the sequence reasons (``<think>`` ... ``</think>``):
        # the grammar applies to the answer, from the token after the reasoning's end
        self.held_matcher: Any = None
        # how it samples (the output processor's SampleSpec), kept once nothing is banned any
        # more (min_tokens reached): from then on it is the same every step
        self.spec: Any = None

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def output_start(self) -> int:
        """Where the output begins in ``token_ids``, earlier attempts' output included (what
        penalties count as output)."""
        return self.prompt_len - self.prior_output

    def seed_draw(self) -> torch.Generator | None:
        """The private RNG (None: unseeded) seeded for the draw of this sequence's next
        output position, counted from the request's first output token: each draw depends on
        (seed, sample index, position) alone, not on how many draws came before here."""
        g = self.generator
        if g is not None:
            assert self.seed_base is not None
            g.manual_seed(position_seed(self.seed_base, self.prior_output + self.num_output))
        return g

    @property
    def num_remaining(self) -> int:
        """Tokens still to compute before this sequence yields logits again."""
        return len(self.token_ids) - self.num_computed

    def fork(
        self, index: int, generator: torch.Generator | None, text: OutputText | None
    ) -> Sequence:
        """A copy sharing history (the caller forks the KV blocks under the new ``seq_id``)."""
        child = Sequence(
            index, list(self.token_ids), self.prompt_len, text, generator, self.prior_output
        )
        child.num_computed = self.num_computed
        child.allocated = self.allocated
        child.cumulative_logprob = self.cumulative_logprob
        if self.matcher is not None:
            child.matcher = self.matcher.deep_copy()
        if self.held_matcher is not None:
            child.held_matcher = self.held_matcher.deep_copy()
        return child

    def reset_for_recompute(self) -> None:
        self.num_computed = 0
        self.allocated = False
        self.pending_logits = None

    @property
    def has_news(self) -> bool:
        return bool(self.new_tokens) or (self.finish_reason is not None and not self.finish_sent)

    def take_delta(self) -> CompletionDelta:
        finished = self.finish_reason is not None
        self.finish_sent = finished
        delta = CompletionDelta(  # positional: one per sequence per step
            self.index,
            self.text.take_delta(finished) if self.text is not None else "",
            self.new_tokens,
            self.new_logprobs or None,
            self.finish_reason,
            self.stop_reason,
            self.cumulative_logprob,
        )
        self.new_tokens, self.new_logprobs = [], []
        return delta


class Request:
    """A prompt and its sampling parameters, plus everything the engine tracks about it."""

    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        arrival_index: int,
        ctx: HashContext,
        max_new_tokens: int,
    ) -> None:
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.arrival_index = arrival_index  # arrival order: FCFS key and tie-breaker
        self.arrival_time = time.monotonic()
        self.ctx = ctx  # model / tenant salt for block keys
        self.max_new_tokens = max_new_tokens  # max_tokens capped by max_model_len
        self.status = RequestStatus.WAITING
        self.seqs: list[Sequence] = []  # live sequences (beams: in rank order)
        self.done_seqs: list[Sequence] = []  # finished samples
        self.forked = params.n == 1 or params.use_beam_search  # n>1: samples forked yet?
        self.beam: BeamSearch | None = None
        self.num_cached_tokens: int | None = None  # prefix-hit tokens at first admission
        self.num_host_cached_tokens = 0  # of those, loaded back from the host tier
        self.protected = False  # resumed after preemption and not progressed since
        self.progressed = False  # produced tokens since the last output (TTFT / ITL)
        self.doomed = False  # cannot fit the KV cache even alone: finish after this step
        self.error: str | None = None
        self.admitted_time: float | None = None  # first admission (queue time ends)
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_preemptions = 0
        self.overtaken = 0  # admissions of later requests while it waited (admission.py)
        self.final_deltas: list[CompletionDelta] = []  # beam search: results at the end
        # SamplingParams.bad_words as token ids (worker.engine.intake.bad_word_ids)
        self.bad_words: tuple[tuple[int, ...], ...] = ()
        # per prompt position, filled as its chunks run (SamplingParams.prompt_logprobs)
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            [None] * len(prompt_ids) if params.prompt_logprobs is not None else None
        )
        self.prompt_logprobs_sent = False
        # structured outputs: the compile of its grammar (a Future of the template matcher)
        # and whether it still waits for it (the scheduler does not admit it until then)
        self.grammar: Future | None = None
        self.awaiting_grammar = False
        # structured outputs on a reasoning model: where the prompt leaves the output
        # (``ReasoningMarkers.prompt_state``; None: no grammar, no markers or reasoning off).
        # "open": its sequences start with the grammar held until the reasoning ends
        self.reasoning: PromptReasoning | None = None
        # state "none": its first output token may open the reasoning (``<think>`` allowed
        # despite the grammar); cleared once that token is sampled
        self.may_open_reasoning = False

    @property
    def priority(self) -> int:
        return self.params.priority

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def num_seq_slots(self) -> int:
        """Sequences this request may run at once (reserved against ``max_num_seqs``)."""
        return len(self.seqs) if self.forked else self.params.n

    def completion_tokens(self) -> int:
        if self.params.use_beam_search:
            return sum(len(d.token_ids) for d in self.final_deltas)
        seqs, done = self.seqs, self.done_seqs
        if len(seqs) == 1 and not done:  # n == 1 running: every output of every step asks
            seq = seqs[0]
            return len(seq.token_ids) - seq.prompt_len
        return sum(s.num_output for s in (*seqs, *done))

    def usage(self) -> Usage:
        return Usage(
            len(self.prompt_ids),
            self.num_cached_tokens or 0,
            self.completion_tokens(),
            self.num_host_cached_tokens,
        )

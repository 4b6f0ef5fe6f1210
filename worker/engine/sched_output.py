"""What the scheduler decided for one step (consumed by the engine's step loop)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from worker.kv import TierTransfers

if TYPE_CHECKING:
    from worker.engine.request import Request, Sequence


@dataclass(slots=True)
class ScheduledChunk:
    """Tokens of one sequence to run through the model in this step."""

    req: Request  # owning request
    seq: Sequence  # the sequence (sample or beam)
    start: int  # tokens of the sequence already in the KV cache before this chunk
    num_tokens: int  # tokens computed now: 1 for a decode, more for a prefill (chunk)
    wants_logits: bool  # the chunk reaches the sequence's end: logits for its next token
    block_table: list[int]  # physical blocks covering start + num_tokens tokens
    drafts: list[int] = field(default_factory=list)  # speculative draft tokens verified after
    # the sequence's next token (counted in num_tokens; one logits row each, plus the token's)

    @property
    def token_ids(self) -> list[int]:
        if self.drafts:
            return [self.seq.token_ids[self.start], *self.drafts]
        return self.seq.token_ids[self.start : self.start + self.num_tokens]


@dataclass(slots=True)
class SchedulerOutput:
    """One step's batch and the bookkeeping that came with it."""

    chunks: list[ScheduledChunk] = field(default_factory=list)  # decodes first, then prefills
    transfers: TierTransfers = field(default_factory=TierTransfers)  # host tier copies: run
    # first (offloads read blocks this step overwrites; loads fill blocks it reads)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # CoW (src, dst) to run
    # before the forward pass
    num_batched_tokens: int = 0  # sum of num_tokens over chunks (<= the step's token budget)
    num_prefill_tokens: int = 0  # of those, tokens of prefills and prefill chunks
    num_draft_tokens: int = 0  # of those, speculative draft tokens being verified
    num_partial_prefills: int = 0  # prefill chunks that stop short of their prompt (chunked)
    admitted: list[str] = field(default_factory=list)  # request ids moved waiting -> running
    resumed: list[str] = field(default_factory=list)  # of those, ids resumed after preemption
    preempted: list[str] = field(default_factory=list)  # ids preempted (blocks freed) this step
    swapped: list[str] = field(default_factory=list)  # of those, ids whose KV was kept (swap)
    recomputed_tokens: int = 0  # tokens resumed requests compute again (in neither tier)
    doomed: list[Request] = field(default_factory=list)  # cannot fit even alone: finish them
    # with "length" after this step

    @classmethod
    def make_empty(cls) -> SchedulerOutput:
        return cls()

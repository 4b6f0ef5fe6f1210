"""A replayed request, the record of what happened to it (what the replay reports), and its
state while a simulated worker holds it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore.blocks.hashing import BlockKey, HashContext
from kvstore.blocks.tiers import Tier


@dataclass(slots=True)
class SimRequest:
    """One request of a replayed workload."""

    request_id: str  # unique id (also the KV sequence id)
    arrival_s: float  # arrival time, seconds from the start
    token_ids: Sequence[int]  # prompt tokens
    output_len: int  # tokens to generate (>= 1)
    ctx: HashContext = HashContext()  # model / LoRA / tenant salt


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request."""

    request_id: str  # its id
    worker_id: str  # where it ran
    arrival_s: float  # arrival time
    input_len: int  # prompt tokens
    output_len: int  # generated tokens
    expected_cached: int  # prompt tokens the router expected to hit
    cached_tokens: int = 0  # prompt tokens actually served from the prefix cache
    # of those, the ones loaded back from each KV tier below the device
    tier_cached_tokens: dict[Tier, int] = field(default_factory=dict)
    first_token_s: float = math.nan  # end of the step that finished its prefill
    finish_s: float = math.nan  # end of the step that produced its last token
    rejected: bool = False  # could never fit in this worker's KV cache
    pulled_tokens: int = 0  # prompt tokens imported from a peer before admission


class ActiveRequest:
    """A request inside a simulated worker: its progress and what the queue counted for it."""

    __slots__ = ("req", "rec", "keys", "pos", "est_new", "claim", "decode_left", "ctx_len")

    def __init__(self, req: SimRequest, rec: RequestRecord, keys: Sequence[BlockKey]) -> None:
        self.req = req
        self.rec = rec
        self.keys = keys  # the router's block keys for this prompt (parity check)
        self.pos = 0  # prompt tokens computed or cached so far
        self.est_new = 0  # uncached tokens counted into the queue before admission
        self.claim: list[BlockKey] = []  # while waiting: its prompt's full-block keys
        self.decode_left = 0  # tokens still to decode
        self.ctx_len = 0  # KV length while decoding

"""A replayed request, and the record of what happened to it (what the replay reports)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.blocks.hashing import HashContext


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
    host_cached_tokens: int = 0  # of those, loaded back from the host KV tier
    first_token_s: float = math.nan  # end of the step that finished its prefill
    finish_s: float = math.nan  # end of the step that produced its last token
    rejected: bool = False  # could never fit in this worker's KV cache
    pulled_tokens: int = 0  # prompt tokens imported from a peer before admission

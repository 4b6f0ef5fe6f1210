"""Workloads for the trace-replay benchmark, as streams of :class:`SimRequest`.

- :func:`trace_requests`: the Mooncake conversation trace. Each 512-token hash id becomes
  deterministic token ids (a keyed hash of (seed, id, position)), so equal ids give equal
  tokens and the engine's own chained block hashes reproduce the trace's sharing; the last
  block is cut to ``input_length``. Tokens are built lazily, one request at a time.
- :func:`shared_prefix_requests`: a seeded synthetic workload: groups of conversations
  sharing a long system prompt, multi-turn conversations whose history grows, sessions
  starting in same-group bursts (siblings arriving together).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from benchmarks.trace_path import find_trace
from kvstore.blocks.hashing import HashContext
from router.sim import SimRequest

TRACE_BLOCK_TOKENS = 512  # tokens per hash id in the Mooncake trace
VOCAB = 32_000
DEFAULT_TRACE = find_trace()  # the conversation trace, wherever this checkout is (trace_path.py)
_INTS = np.array(range(VOCAB), dtype=object)  # shared int objects: token lists cost 8 B/token
_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)
TRACE_CTX = HashContext("mooncake-trace")  # model id the replayed requests carry
SHARED_PREFIX_CTX = HashContext("shared-prefix")


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser over uint64 (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def segment_tokens(seed: int, segment_ids: np.ndarray, length: int, per_segment: int) -> list[int]:
    """Tokens of consecutive segments (``per_segment`` tokens each), cut to ``length``.

    Token j of segment s is a pure function of (seed, s, j): equal ids, equal tokens.
    """
    pos = np.arange(length, dtype=np.uint64)
    seg = segment_ids.astype(np.uint64)[pos // np.uint64(per_segment)]
    key = (seg * np.uint64(per_segment) + pos % np.uint64(per_segment)) & _MASK
    salt = _mix(np.array([seed], dtype=np.uint64))[0]
    with np.errstate(over="ignore"):
        tokens = _mix(key ^ salt) % np.uint64(VOCAB)
    return _INTS[tokens.astype(np.int64)].tolist()


def trace_requests(
    path: Path = DEFAULT_TRACE,
    *,
    limit: int | None = None,
    seed: int = 0,
    ctx: HashContext = TRACE_CTX,
) -> Iterator[SimRequest]:
    """The trace's requests in file order (timestamps in ms -> seconds)."""
    with open(path) as f:
        for i, line in enumerate(f):
            if limit is not None and i >= limit:
                return
            row = json.loads(line)
            n = int(row["input_length"])
            ids = np.asarray(row["hash_ids"], dtype=np.uint64)
            if len(ids) * TRACE_BLOCK_TOKENS < n:
                raise ValueError(f"trace line {i + 1}: {len(ids)} hash ids for {n} tokens")
            yield SimRequest(
                request_id=f"t{i:06d}",
                arrival_s=row["timestamp"] / 1000.0,
                token_ids=segment_tokens(seed, ids, n, TRACE_BLOCK_TOKENS),
                output_len=max(1, int(row["output_length"])),
                ctx=ctx,
            )


def shared_prefix_requests(
    *,
    seed: int = 0,
    groups: int = 12,
    system_tokens: int = 6000,
    sessions: int = 600,
    burst: int = 4,
    session_rate_s: float = 1.2,
    max_turns: int = 6,
    user_tokens: tuple[int, int] = (100, 1500),
    output_tokens: tuple[int, int] = (30, 400),
    think_s: float = 20.0,
    ctx: HashContext = SHARED_PREFIX_CTX,
) -> list[SimRequest]:
    """Groups sharing a ``system_tokens`` system prompt (popularity ~ 1/rank); sessions
    start in bursts of ``burst`` from one group at ``session_rate_s`` sessions/s; each has
    1..max_turns turns whose prompt is system + all earlier turns (user + reply) + the new
    user message; ``think_s`` mean think time between a reply and the next turn."""
    rng = random.Random(seed)
    weights = [1.0 / (g + 1) for g in range(groups)]
    events: list[tuple[float, int, int, list[int], int]] = []  # (time, session, turn, ...)
    t = 0.0
    for s in range(sessions):
        if s % burst == 0:
            t += rng.expovariate(session_rate_s / burst)
            group = rng.choices(range(groups), weights)[0]
        start = t + rng.uniform(0.0, 0.2)
        history = [("sys", group, system_tokens)]
        for turn in range(rng.randint(1, max_turns)):
            history.append(("user", s * 100 + turn, rng.randint(*user_tokens)))
            out = rng.randint(*output_tokens)
            events.append((start, s, turn, list(history), out))
            history.append(("bot", s * 100 + turn, out))
            start += out * 0.03 + rng.expovariate(1.0 / think_s)
    events.sort(key=lambda e: (e[0], e[1], e[2]))
    kinds = {"sys": 1, "user": 2, "bot": 3}
    out_reqs = []
    for t, s, turn, history, out in events:
        tokens: list[int] = []
        for kind, ident, n in history:
            sid = np.array([kinds[kind] << 40 | ident], dtype=np.uint64)
            tokens += segment_tokens(seed, sid, n, n)
        out_reqs.append(SimRequest(f"s{s:05d}.{turn}", t, tokens, out, ctx))
    return out_reqs

"""Encoding of script arguments and replies, and the mapping of Redis errors; shared by the
client (:mod:`kvstore.index`)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

import redis

from kvstore.blocks.hashing import KEY_BYTES, BlockKey
from kvstore.blocks.tiers import HELD_TIERS, Tier
from kvstore.index_types import ApplyResult, IndexUnavailable, WorkerInfo, WorkerLoad
from kvstore.recorder import Op

T = TypeVar("T")

# Redis answers that mean "not available right now" rather than "bad request".
_UNAVAILABLE_REPLIES = ("BUSY", "LOADING", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN")


def key_blob(keys: Sequence[BlockKey]) -> bytes:
    """Concatenated 16-byte keys: how keys travel to the scripts (one argument, not n)."""
    blob = b"".join(keys)
    if len(blob) != KEY_BYTES * len(keys):
        raise ValueError(f"block keys must be {KEY_BYTES} bytes each")
    return blob


def encode_ops(ops: Iterable[Op]) -> list[bytes]:
    """Script arguments for ops: (op, blob) pairs, op being ``C`` or the kind followed by the
    tier's value (``Sdevice``); consecutive ops of a kind and tier merged."""
    args: list[bytes] = []
    run_op: str | None = None
    run: list[BlockKey] = []
    for kind, keys, tier in ops:
        op = kind if tier is None else kind + tier.value
        if op != run_op or kind == "C":
            if run_op is not None:
                args += [run_op.encode(), key_blob(run)]
            run_op, run = op, []
        run.extend(keys)
    if run_op is not None:
        args += [run_op.encode(), key_blob(run)]
    return args


def decode_lookup(reply: list, record_every: int) -> dict[str, int]:
    return {reply[i].decode(): int(reply[i + 1]) * record_every for i in range(0, len(reply), 2)}


def decode_lookup_tiers(reply: list, record_every: int) -> dict[str, dict[Tier, int]]:
    """Per worker, its leading blocks per tier (the tiers holding none left out)."""
    k, n = record_every, len(HELD_TIERS)
    out: dict[str, dict[Tier, int]] = {}
    for i in range(0, len(reply), n + 1):
        counts = zip(HELD_TIERS, reply[i + 1 : i + 1 + n], strict=True)
        out[reply[i].decode()] = {tier: int(c) * k for tier, c in counts if int(c)}
    return out


def decode_live(reply: list) -> dict[str, WorkerInfo]:
    out: dict[str, WorkerInfo] = {}
    for i in range(0, len(reply), 3):
        worker_id = reply[i].decode()
        epoch = int(reply[i + 1].split(b":")[1])
        payload = json.loads(reply[i + 2])
        out[worker_id] = WorkerInfo(
            worker_id, epoch, WorkerLoad.from_dict(payload["l"]), payload.get("a")
        )
    return out


def decode_apply(reply: list) -> ApplyResult:
    code = int(reply[0])
    if code == 0:
        return ApplyResult(True, False, added=int(reply[1]), removed=int(reply[2]))
    if code == -1:
        return ApplyResult(False, True, stale_epoch=True)
    if code == -2:
        return ApplyResult(False, False, duplicate=True)
    assert code == -3, f"unexpected apply reply {reply!r}"
    return ApplyResult(False, True)


def heartbeat_payload(address: str | None, load: WorkerLoad | None) -> bytes:
    load_dict = load.to_dict() if load is not None else WorkerLoad(0, 0, 0, 0, 0).to_dict()
    return json.dumps({"a": address, "l": load_dict}, separators=(",", ":")).encode()


def check_worker_id(worker_id: str) -> None:
    if not worker_id or any(ch in worker_id for ch in "\n\r\0{}"):
        raise ValueError(f"worker id {worker_id!r} must be non-empty, without newlines or braces")


def guard(call: Callable[[], T]) -> T:
    """Run a redis-py call, turning outages and timeouts into :class:`IndexUnavailable`."""
    try:
        return call()
    except Exception as exc:
        err = translate(exc)
        if err is exc:
            raise
        raise err from exc


def translate(exc: Exception) -> Exception:
    """:class:`IndexUnavailable` for outages, timeouts and "try later" replies; else ``exc``."""
    if isinstance(exc, redis.ConnectionError | redis.TimeoutError | OSError) or (
        isinstance(exc, redis.ResponseError) and str(exc).split(" ", 1)[0] in _UNAVAILABLE_REPLIES
    ):
        return IndexUnavailable(f"Redis index unavailable: {exc}")
    return exc

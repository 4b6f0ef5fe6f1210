"""Every command the engine loop takes (:class:`~worker.engine.engine_loop.EngineLoop`).

Other threads never touch the engine: they queue one of these frozen records in the loop's
inbox, and the engine thread runs it between steps (``EngineLoop._execute`` is the one place
that dispatches them), so the engine's whole cross-thread API is this module. A command with
an answer is queued with a future (``EngineLoop.call`` / ``call_async``); ``post`` queues one
without waiting. Each docstring says what the engine thread does and what the future holds.

One command runs beside the step instead of between steps: :class:`ExportRun`
(``EngineLoop.export_async``), while the model computes its forward (``window.py``).

Tests inspect the engine through a command or the documented hook :meth:`EngineLoop.paused`
(the loop parks between two steps and the calling thread reads the engine itself until the
block ends); no closure crosses into the engine thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.blocks.hashing import BlockKey, HashContext
from kvstore.requests.sampling_params import SamplingParams
from worker.engine.streams import OutputSink
from worker.kv.transfer import BlockRun


@dataclass(frozen=True, slots=True)
class AddRequest:
    """Add a request whose prompt and parameters passed ``Engine.check_request`` (in the
    caller's thread); its outputs go to ``sink``. Answer: None, or InvalidRequest for a
    duplicate id / EngineOverloaded for a full waiting queue."""

    request_id: str
    prompt_ids: list[int]  # the prompt's token ids (the engine copies them)
    params: SamplingParams
    prompt_keys: Sequence[BlockKey] | None  # the prompt's block keys, if hashed already
    sink: OutputSink  # where its outputs go
    continued: int = 0  # the prompt's last tokens that are its own earlier output (moved)


@dataclass(frozen=True, slots=True)
class AddBurst:
    """Add checked requests in one command (one router loop turn's). Answer: ``{position:
    error}`` for the requests refused (as :class:`AddRequest` would be), each alone."""

    requests: tuple[AddRequest, ...]


@dataclass(frozen=True, slots=True)
class Abort:
    """Abort a request; its last output follows with the next step. No answer (posted)."""

    request_id: str


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Answer: the engine's :class:`~worker.engine.metrics.EngineSnapshot`."""

    pins_max_age_s: float = 0.0  # a waiting-pinned count this old may be reused


@dataclass(frozen=True, slots=True)
class Metrics:
    """Answer: the engine's :class:`~worker.engine.metrics.EngineMetrics`."""


@dataclass(frozen=True, slots=True)
class AddLora:
    """Register a LoRA adapter folder (``Engine.add_lora``). Answer: its stable id."""

    name: str
    path: str
    tenants: tuple[str, ...] | None  # the only tenants it serves (None: every tenant)


@dataclass(frozen=True, slots=True)
class RemoveLora:
    """Unregister a run-time LoRA adapter (``Engine.remove_lora``): its requests end with an
    error naming it. Answer: False when no adapter has the name; LoraError for one of the
    engine config."""

    name: str


@dataclass(frozen=True, slots=True)
class ResetPrefixCache:
    """Drop every cached block (``KVCacheManager.reset_prefix_cache``). Answer: False when
    blocks are in use (nothing is dropped then)."""


@dataclass(frozen=True, slots=True)
class DrainEvents:
    """Answer: the engine's KV events not yet handed out (``Engine.drain_kv_events``); at start,
    what it held before its first step (a disk tier's runs), for the worker to announce."""


@dataclass(frozen=True, slots=True)
class ImportRun:
    """Write a peer's block run into the cache (``kv_pull.import_run``). Answer: its
    ``ImportResult``; ImportRefused when the run does not match the prompt."""

    run: BlockRun
    token_ids: Sequence[int]  # the prompt the run is a prefix of
    ctx: HashContext
    keys: Sequence[BlockKey] | None = None  # the prompt's keys, if hashed already


@dataclass(frozen=True, slots=True)
class ExportRun:
    """Copy out the leading run of ``keys`` this engine holds (``kv_pull.export_run``),
    beside the forward in flight. Answer: the ``BlockRun``, or None when it holds none."""

    keys: tuple[BlockKey, ...]
    ctx: HashContext
    start: int = 0  # the first key's block index in its prompt


@dataclass(frozen=True, slots=True)
class SetSpares:
    """The keys another worker holds too: evicted first here (``KVCacheManager.set_spares``).
    Answer: the seconds it took (the caller paces its refreshes by it)."""

    keys: frozenset[BlockKey]


@dataclass(frozen=True, slots=True)
class CachedKeys:
    """Answer: the cached blocks' keys per tier (device and every lower tier stacked here),
    for an index resync. ``mark`` runs on the engine thread at the moment of the read, where
    no step's events can be submitted (the publisher's ``mark_snapshot``)."""

    mark: Callable[[], None] | None = None


@dataclass(frozen=True, slots=True)
class AnnounceState:
    """Run the loop's step hook with no outputs, as after an empty step: an idle engine
    publishes its KV events and load now (after imports, a new adapter). No answer."""


@dataclass(frozen=True, slots=True)
class ComputeThreads:
    """Answer: the intra-op thread count the engine thread's model runs with (torch's,
    per thread)."""


@dataclass(frozen=True, slots=True)
class Pause:
    """The test hook behind :meth:`EngineLoop.paused`: the engine thread sets ``parked``
    and waits, holding the engine, until ``resume`` is set. No answer."""

    parked: threading.Event
    resume: threading.Event


Command = (
    AddRequest
    | AddBurst
    | Abort
    | Snapshot
    | Metrics
    | AddLora
    | RemoveLora
    | ResetPrefixCache
    | DrainEvents
    | ImportRun
    | ExportRun
    | SetSpares
    | CachedKeys
    | AnnounceState
    | ComputeThreads
    | Pause
)
"""The closed set of commands."""

ADDS = (AddRequest, AddBurst)  # refused, not run, once the loop died

"""What a router and a worker actor exchange (plain dataclasses, pickled by Ray by field
name: see wire.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvstore.blocks.hashing import BlockKey
from kvstore.blocks.tiers import Tier
from kvstore.requests.histograms import HistogramCounts
from kvstore.requests.sampling_params import SamplingParams
from kvstore.requests.wire import ByName


@dataclass(frozen=True, slots=True)
class WorkerRequest(ByName):
    """One request as the router hands it to the chosen worker."""

    request_id: str  # unique id; the engine's request id
    token_ids: list[int]  # the tokenized prompt
    params: SamplingParams  # validated sampling parameters (cache_salt, priority inside)
    want_keys: bool = True  # send the prompt's last block key back in Admitted (parity check)
    pull: PullHint | None = None  # pull part of the prefix from a peer before queueing
    # the last ``continued`` tokens of token_ids are the request's own output, sent by an
    # earlier attempt (a moved stream): seeded draws and penalties count them as output
    continued: int = 0


@dataclass(frozen=True, slots=True)
class PullHint(ByName):
    """The router's advice: blocks ``start_block .. start_block + num_blocks - 1`` of the
    prompt are cached on ``source_id``; fetch them instead of recomputing, unless that takes
    longer than ``deadline_s`` (then recompute: a pull never fails or holds a request)."""

    source_id: str  # the holder's registry id (its Ray actor name)
    start_block: int  # first block to fetch (the chosen worker is expected to hold those before)
    num_blocks: int  # blocks to fetch
    deadline_s: float  # soft deadline of the whole pull (export, transfer, import)
    priced_s: float = 0.0  # what the router's transfer model predicted it takes


@dataclass(frozen=True, slots=True)
class PullReport(ByName):
    """What a worker did with a :class:`PullHint` (sent back in :class:`Admitted`)."""

    source_id: str  # where it pulled from
    outcome: str  # "ok", or why it recomputed: "missing", "source-gone", "timeout", "refused"
    blocks: int  # blocks imported (0 unless ok)
    tokens: int  # their tokens
    seconds: float  # wall time of the pull, export to import
    nbytes: int = 0  # payload bytes moved
    node: str = ""  # the importer's node id (the router's transfer model is per node pair)
    source_node: str = ""  # the source's node id ("" when not reached)


@dataclass(frozen=True, slots=True)
class Admitted(ByName):
    """First item of every worker stream: the request was queued on this worker."""

    worker_id: str  # the worker's registry id
    epoch: int | None  # its registration epoch in the index (None: index not reached yet)
    last_key: BlockKey | None  # the key of the prompt's last full block as this worker
    # computes it (keys are chained: it names the whole prefix); None unless the request's
    # want_keys (routers that do not hash prompts skip it) and the prompt has a full block
    pulled: PullReport | None = None  # the request's pull, if it carried a PullHint


@dataclass(frozen=True, slots=True)
class TierFigures(ByName):
    """One KV tier below a worker's device, as its snapshot and status report it."""

    total_blocks: int  # the tier's size
    cached_blocks: int = 0  # blocks it holds now
    hit_tokens: int = 0  # prompt tokens loaded back from it since start
    loaded_blocks: int = 0  # blocks copied from it to the device since start
    stored_blocks: int = 0  # blocks copied into it (evictions, swap-outs) since start


# why a worker's request waits (WorkerStatus.waiting_by_reason), as its engine's last
# admission pass found: the step's token budget was spent (or its prompt does not fit the
# budget without chunked prefill), the batch is at max_num_seqs, its KV blocks do not fit
# (or the admission watermark; in a step that preempted nobody is admitted), every LoRA slot
# is taken, its grammar is compiling, its cached prefix is being written in that step,
# cache-aware admission holds it behind a request at its bound; a request behind the one
# that stopped the pass waits for the same reason; "new": queued since that pass
WAIT_REASONS = ("budget", "max_num_seqs", "kv_blocks", "lora", "grammar", "deferred", "order")
WAIT_REASONS += ("new",)


@dataclass(frozen=True, slots=True)
class WorkerStatus(ByName):
    """A worker's state for ClusterStatus and the dashboard."""

    worker_id: str
    epoch: int | None
    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    queued_prefill_tokens: int
    prefix_hit_rate: float
    index_healthy: bool
    waiting_pinned_blocks: int = 0  # cached blocks its waiting requests will pin
    tenant_quota_evictions: int = 0  # idle cached blocks evicted over their tenant's quota
    # its KV tiers below the device (a tier not named: none)
    tiers: dict[Tier, TierFigures] = field(default_factory=dict)
    swap_preemptions: int = 0  # preemptions that kept the victim's KV (host tier)
    recompute_preemptions: int = 0  # preemptions that dropped it
    adapters: tuple[AdapterInfo, ...] = ()  # LoRA adapters registered on this worker
    # vLLM's histograms measured in the engine, by name less "vllm:" and "_seconds"
    # (request_queue_time, ..., kv_block_reuse_gap: worker/engine/metrics.py EngineSnapshot)
    histograms: dict[str, HistogramCounts] = field(default_factory=dict)
    # waiting requests by why the engine's last admission pass left them waiting
    waiting_by_reason: dict[str, int] = field(default_factory=dict)
    # seconds this start of the worker took to load its model and build its engine (a node
    # that joins, or a worker Ray restarted, serves no sooner); None: not measured
    model_load_s: float | None = None
    # speculative decoding since start, in vLLM's names: sequences that verified drafts in a
    # step, draft tokens verified, of those accepted, and accepted at each draft position
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    # filled in by the router, not the worker:
    stale: bool = False  # no answer to a status call within its timeout, or no heartbeat
    heartbeat_age_s: float | None = None  # since the router last saw its heartbeat; None: never


@dataclass(frozen=True, slots=True)
class CallerRef(ByName):
    """Who sent a request: the router's actor and the id of its current incarnation. A
    router that Ray restarted answers with a new id, so its predecessor's requests (whose
    streams nobody reads any more) are known orphans."""

    handle: Any  # the router's Ray actor handle
    incarnation: str  # random per start of that router


@dataclass(frozen=True, slots=True)
class AdapterInfo(ByName):
    """One LoRA adapter of a worker."""

    name: str  # what requests ask for
    adapter_id: str  # stable id folded into block keys
    loaded: bool  # in a device slot now
    tenants: tuple[str, ...] = ()  # the tenants that may see and use it (empty: every tenant)

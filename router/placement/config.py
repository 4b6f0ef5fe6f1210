"""Typed, validated configuration of the placement policies (pydantic, unknown keys rejected)."""

from __future__ import annotations

from pydantic import Field, field_validator

from kvstore.blocks import sampling_params as hard
from kvstore.blocks.strict import Strict
from router.placement.policies import ROUTING_POLICIES

# engine steps whose tokens one client message carries at least (router.stream_interval)
STREAM_INTERVAL = 1


class LoadWeights(Strict):
    """How a worker's reported load converts into one number, in prefill-token units."""

    decode_weight: float = Field(
        0.0,
        ge=0,
        description="Cost of one unit of WorkerLoad.decode_tokens, in prefill tokens. Decode "
        "work slows prefill down only a little per running sequence; 0 ignores it.",
    )


class LeastLoadedConfig(LoadWeights):
    """``least_loaded``: power of d choices on load."""

    choices: int = Field(2, ge=1, description="Workers sampled per request (2 = two choices).")


class PrefixAffinityConfig(LoadWeights):
    """``prefix_affinity``: cheapest worker by uncached prefill + load, under a load bound.

    cost(w) = prefill_weight * (prompt - cached(w)) + queued_prefill(w) + decode_weight *
    decode(w); a worker whose load exceeds mean + max(balance_slack * mean,
    balance_abs_tokens), or whose requests exceed mean + max(balance_slack * mean,
    balance_abs_requests), is not eligible (the least-loaded worker always is).
    """

    prefill_weight: float = Field(
        2.0,
        gt=0,
        description="Cost of one uncached prompt token relative to one queued token. 1 makes "
        "the cost this prompt's own time to first token (FCFS); but a token computed now also "
        "delays every later request on that worker, which > 1 charges for (like Dynamo's "
        "overlap weight). 2 gave the best hit rate at equal TTFT in the trace replay.",
    )
    balance_slack: float = Field(
        0.5,
        ge=0,
        description="Relative load bound: workers above (1 + slack) x mean load are skipped. "
        "Larger keeps more affinity, smaller balances harder.",
    )
    balance_abs_tokens: int = Field(
        65536,
        ge=0,
        description="Absolute load bound in prefill tokens: a few long prompts' worth, so "
        "ordinary queue swings (one 30k-token prompt) never break a conversation's affinity; "
        "only a runaway holder does.",
    )
    balance_abs_requests: int | None = Field(
        8,
        ge=0,
        description="Second load bound, on requests in a worker (running + waiting): workers "
        "above mean + max(slack x mean, this) are skipped too, unless that leaves none. Queued "
        "prefill is ~0 on a lightly loaded cluster, so only this bound stops a popular system "
        "prompt's holder from collecting every new session (its decode batch and KV memory "
        "grow). None disables.",
    )
    adapter_load_tokens: float = Field(
        256.0,
        ge=0,
        description="Cost, in prefill tokens, of running a LoRA request on a worker that does "
        "not hold its adapter in a device slot (loading it, and evicting another's). Small "
        "against a long cached prefix, so a hot adapter can still spread under load.",
    )
    capacity_aware: bool = Field(
        True,
        description="Place a prefix only on a worker whose KV blocks hold it next to the other "
        "prefixes the router homed there (router/placement/prefix_homes.py), when one has room: a "
        "holder full of other hot prefixes spills it (pulled there when pulls are on) instead "
        "of thrashing, and first placements spread by KV capacity.",
    )
    home_ttl_s: float = Field(
        30.0,
        gt=0,
        description="A prefix stops counting against its home worker's KV this long after "
        "its last placement (a first touch, committed whole: after routing.pending_ttl_s "
        "if shorter).",
    )


class PullConfig(Strict):
    """Peer pulls (``router/placement/pull.py``): per request, hold at the prefix's holder,
    pull the prefix to another worker, or recompute it there — whichever ends the prefill
    first by the router's estimates."""

    enabled: bool = Field(
        False, description="Price pulls per request (workers must share an object store)."
    )
    prefill_tokens_per_s: float = Field(
        2000.0,
        gt=0,
        description="Starting estimate of a worker's prefill rate (uncached prompt tokens per "
        "second); refined from the first tokens of requests placed on idle workers.",
    )
    fixed_s: float = Field(
        0.005, ge=0, description="Starting fixed cost of one pull (calls, lock wait, import)."
    )
    per_token_s: float = Field(
        2e-6, ge=0, description="Starting per-token cost of a pull between two workers."
    )
    cross_node_factor: float = Field(
        4.0, ge=1, description="Both costs times this for a pair of workers on two nodes."
    )
    alpha: float = Field(
        0.2, gt=0, le=1, description="Weight of each observed pull in refining its pair's cost."
    )
    min_pull_tokens: int = Field(
        64, ge=1, description="Prefixes shorter than this are recomputed, never pulled."
    )
    min_deadline_s: float = Field(
        0.05,
        gt=0,
        description="Floor of a pull's soft deadline (its break-even against recomputing).",
    )
    warm_start_prefixes: int = Field(
        16,
        ge=0,
        le=4096,
        description="A new or restarted worker pulls this many of the fleet's most used "
        "prefixes from its peers while it takes its first requests (0: no warm start).",
    )
    warm_start_share: float = Field(
        0.5,
        ge=0,
        le=1,
        description="At most this share of the new worker's device KV blocks is filled by "
        "its warm start (the rest stays free for its own requests).",
    )
    source_step_tokens: int = Field(
        0,
        ge=0,
        description="Prefill tokens of the holder's step in flight a pull waits for before "
        "the export starts (at most its queued prefill). 0 for these workers: they export "
        "while their model computes a step (worker/engine/window.py), so a busy holder "
        "delays a pull by no step; a simulated or other worker that exports only between "
        "steps sets its max_num_batched_tokens.",
    )
    slow_factor: float = Field(
        2.0,
        ge=1,
        description="A pull that takes more than this x its priced time is counted as slow.",
    )
    max_pulls_per_source: int = Field(
        2,
        ge=1,
        description="This router's pulls in flight from one holder at most; past it a "
        "request recomputes (each export waits for its own window of the holder's engine).",
    )
    hold_max_extra_requests: int = Field(
        8,
        ge=0,
        description="Under a load-only policy (least_loaded, round_robin), the prefix's "
        "holder is priced as a choice while it runs at most this many requests (running + "
        "waiting) more than the policy's choice (the bound keeps holds from herding).",
    )
    survival_recovery_s: float = Field(
        10.0,
        gt=0,
        description="Half-life of what a worker's missed pulls (imported blocks evicted "
        "before their request ran) take off the price of pulling to it.",
    )


class RequestLimits(Strict):
    """Every per-request limit the router enforces at the edge, in one place (the engine
    re-checks what it must: vocabulary, max_model_len, KV size, max_num_seqs). A request over
    a limit gets INVALID_ARGUMENT naming the field, the value and the limit. Limits that
    ``SamplingParams`` also enforces are capped by its hard limits (``le=hard.MAX_*``): a
    deployment may tighten them, never loosen them past what the engine accepts."""

    max_request_id_chars: int = Field(128, ge=1, description="Client request id length.")
    max_tenant_chars: int = Field(64, ge=1, description="Tenant name length.")
    max_cache_salt_chars: int = Field(256, ge=1, description="cache_salt length.")
    max_prompt_chars: int = Field(
        1 << 20,
        ge=1,
        description="Text prompt length (characters);"
        " token limits come from the model's max_model_len.",
    )
    max_chars_per_token: int = Field(
        16,
        ge=1,
        description="Bound on characters per token of a text that fits the model: "
        "texts over max_model_len x this are rejected before tokenizing (Generate and "
        "Tokenize), so an oversized input costs the router nothing.",
    )
    max_stop_strings: int = Field(
        hard.MAX_STOP_STRINGS, ge=0, le=hard.MAX_STOP_STRINGS, description="Stop strings."
    )
    max_stop_string_chars: int = Field(
        hard.MAX_STOP_STRING_CHARS,
        ge=1,
        le=hard.MAX_STOP_STRING_CHARS,
        description="Length of one stop string.",
    )
    max_n: int = Field(16, ge=1, le=hard.MAX_N, description="Parallel samples or beams.")
    max_logprobs: int = Field(
        hard.MAX_LOGPROBS, ge=0, le=hard.MAX_LOGPROBS, description="Top logprobs per token."
    )


class LivenessConfig(Strict):
    """How a router notices a worker that stopped answering without dying (frozen, wedged,
    partitioned): Ray reports nothing for it, so the router asks."""

    stream_stall_s: float = Field(
        5.0,
        gt=0,
        description="A stream with no output for this long makes the router probe "
        "its worker; a worker that does not answer the probe is given up on: the request is "
        "retried elsewhere when it has streamed nothing, else ends UNAVAILABLE.",
    )
    probe_timeout_s: float = Field(
        3.0,
        gt=0,
        description="How long a worker has to answer that probe (a busy worker "
        "answers in milliseconds: its event loop is not the engine's thread).",
    )
    status_timeout_s: float = Field(
        2.0,
        gt=0,
        description="Per-worker timeout of ClusterStatus; a worker that does not "
        "answer in time is listed as stale, not left out.",
    )


class RoutingConfig(Strict):
    """The router's placement settings. The block size is not one of them: it is the
    workers' (``Router(..., block_size=)``), so the two can never disagree."""

    policy: str = Field("prefix_affinity", description="Registered policy name.")
    pending_ttl_s: float = Field(
        10.0,
        ge=0,
        description="How long the router remembers its own placements' prefixes, so siblings "
        "arriving before the worker's KV events land together. 0 disables.",
    )
    pending_settle_s: float = Field(
        1.0,
        ge=0,
        description="How long a placement's pending prefix is still remembered once its "
        "first token came back (the worker stored its blocks; their events reach the index "
        "within a step). At most pending_ttl_s.",
    )
    seed: int = Field(0, description="Seed of the policies' tie-breaking / sampling RNG.")
    host_hit_weight: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="A block a worker holds in its host KV tier counts as this fraction of a "
        "device hit (it must be loaded back): routing prefers a device hit but still beats "
        "recomputing. 0 ignores the host tier.",
    )
    index_timeout_s: float = Field(
        0.2,
        gt=0,
        description="Socket timeout of the router's index reads (a frozen Redis "
        "costs at most this, once per probe interval).",
    )
    index_probe_interval_s: float = Field(
        1.0,
        gt=0,
        description="After an index read fails, reads are skipped (routing by load) "
        "and one probe per interval checks whether the index is back.",
    )
    adapter_aware: bool = Field(
        True,
        description="Hash LoRA requests' prompts with their adapter id and weigh where adapters "
        "are loaded. False is the adapter-blind baseline (keys without the adapter never "
        "match the workers', so LoRA requests route by load), kept for comparisons.",
    )
    least_loaded: LeastLoadedConfig = LeastLoadedConfig()
    prefix_affinity: PrefixAffinityConfig = PrefixAffinityConfig()
    pull: PullConfig = PullConfig()

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        ROUTING_POLICIES.get(value)  # raises naming the valid ones
        return value

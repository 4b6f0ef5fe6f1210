"""Typed, frozen engine configuration (pydantic, unknown keys rejected)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from kvstore.blocks.hashing import DEFAULT_BLOCK_SIZE
from kvstore.runtime.strict import Strict
from worker.engine.policy import SCHEDULING_POLICIES, policy_names
from worker.model.lora_config import DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS


def check_tenants(adapter: str, tenants: object) -> tuple[str, ...]:
    """The tenants an adapter is registered for, sorted; a ``ValueError`` naming the adapter
    unless they are a non-empty list of non-empty names."""
    if (
        isinstance(tenants, str)
        or not isinstance(tenants, list | tuple)
        or not tenants
        or not all(isinstance(t, str) and t for t in tenants)
    ):
        raise ValueError(
            f"adapter {adapter!r}: tenants={tenants!r} must be a non-empty list of tenant "
            "names (leave it out to serve every tenant)"
        )
    return tuple(sorted(set(tenants)))


class SpeculativeConfig(Strict):
    """Draft-free speculative decoding: a proposer guesses the next tokens of a sequence from
    text it has seen; one forward pass verifies them as extra rows of the sequence (the token
    budget counts them) and keeps the prefix the model agrees with, plus the model's own next
    token. Greedy outputs are token-identical with and without it; a sampled request accepts
    a draft token while the token it samples at that position equals it, so its output
    distribution is unchanged. Draft slots never enter the prefix cache, the index or a tier.

    Speculates with: greedy and unseeded sampling (temperature, top-k/p, min-p), stop strings
    and stop tokens, ``max_tokens``, LoRA adapters (drafts run with the adapter; the suffix
    corpus is keyed by tenant and adapter). Turned off for that request: ``n`` > 1 and beam
    search, a ``seed``, logprobs and prompt logprobs, presence/frequency/repetition penalties,
    logit bias, ``min_tokens`` > 0, structured outputs (grammar masks).
    """

    method: Literal["none", "ngram", "suffix"] = Field(
        "none",
        description="Proposer: none (off), ngram (prompt lookup) or suffix (suffix "
        "decoding over the request and earlier requests of its tenant and adapter).",
    )
    num_speculative_tokens: int = Field(
        5, ge=1, le=32, description="Most draft tokens verified per sequence and step."
    )
    prompt_lookup_min: int = Field(
        2, ge=1, description="Shortest suffix of the sequence a draft may be matched from."
    )
    prompt_lookup_max: int = Field(
        5, ge=1, description="Longest suffix tried first when matching a draft."
    )
    adaptive: bool = Field(
        True,
        description="Size each request's drafts from its running acceptance and the batch's "
        "load, and stop speculating while a verify step costs more than it saves on this "
        "worker (measured).",
    )
    suffix_corpus_tokens: int = Field(
        200_000,
        ge=0,
        description="suffix: tokens of earlier prompts and responses kept per "
        "worker (all tenants together; the least recently used tenant's oldest go first).",
    )

    @model_validator(mode="after")
    def _ordered(self) -> SpeculativeConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min={self.prompt_lookup_min} > prompt_lookup_max="
                f"{self.prompt_lookup_max}: lower the minimum or raise the maximum"
            )
        return self

    @property
    def enabled(self) -> bool:
        return self.method != "none"


class EngineConfig(Strict):
    """Knobs of one worker's engine: batch limits, KV pool size, scheduling policy."""

    max_num_seqs: int = Field(64, ge=1, description="Running sequences per step (decode batch).")
    max_num_batched_tokens: int = Field(
        1024, ge=1, description="Token budget of one step (decodes + prefill chunks)."
    )
    long_prefill_token_threshold: int | None = Field(
        None,
        ge=1,
        description="Per-request cap of prefill tokens in one step (None = no cap beyond the "
        "budget); keeps one long prompt from taking a whole step.",
    )
    enable_chunked_prefill: bool = Field(
        True,
        description="Split long prompts over several steps; if off, a prompt must fit "
        "max_num_batched_tokens.",
    )
    max_waiting: int = Field(
        1024,
        ge=1,
        description="Waiting-queue bound; beyond it add_request raises EngineOverloaded.",
    )
    block_size: int = Field(DEFAULT_BLOCK_SIZE, ge=1, description="Tokens per KV block.")
    num_blocks: int | None = Field(
        None, ge=1, description="KV blocks (None = from kv_memory_bytes or the runner's default)."
    )
    kv_memory_bytes: int | None = Field(
        None, ge=1, description="KV memory budget when num_blocks is None."
    )
    max_model_len: int | None = Field(
        None,
        ge=2,
        description="Longest prompt + completion (None = the model's max_position_embeddings).",
    )
    policy: str = Field("fcfs", description="Scheduling policy: " + ", ".join(policy_names()))
    enable_prefix_caching: bool = Field(True, description="Reuse KV of shared prompt prefixes.")
    tenant_cache_fraction: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="Per-tenant quota of the prefix cache: the share of KV blocks one tenant "
        "(the owner of a cache_salt: a tenant's salts count together; no salt is one tenant "
        "too) may keep cached and idle. Beyond it that "
        "tenant's own least recently used blocks are evicted, so one tenant cannot flush the "
        "others' prefixes. 1.0 = no quota.",
    )
    host_kv_bytes: int = Field(
        0,
        ge=0,
        description="Host-memory KV tier (pinned on CUDA): cached blocks evicted from the "
        "device are kept there and loaded back on a prefix hit; swapped-out preempted requests "
        "too. 0 = off.",
    )
    disk_kv_bytes: int = Field(
        0,
        ge=0,
        description="Disk KV tier below the host tier: blocks the host tier evicts are written "
        "to run files under disk_kv_path (checksummed, atomic, off the engine thread) within "
        "this byte budget, read back on a prefix hit when reading beats recomputing, and "
        "announced again after a restart. Needs host_kv_bytes and prefix caching. 0 = off.",
    )
    disk_kv_path: str = Field(
        "",
        description="Directory of the disk KV tier (local storage, one per worker; created if "
        "missing). A worker restarted on it comes back with what it holds.",
    )
    disk_kv_admit_after: Literal[1, 2] = Field(
        1,
        description="Disk KV tier admission: 1 writes a block the first time the host tier "
        "evicts it, 2 only the second time (keeps one-off prompts off the disk).",
    )
    preemption_mode: Literal["auto", "swap", "recompute"] = Field(
        "auto",
        description="What a preemption does with the victim's KV: 'swap' keeps its blocks for "
        "the host tier, 'recompute' drops them, 'auto' picks the cheaper by estimate "
        "(host_load_block_cost per block vs one per token). Without a host tier: recompute.",
    )
    host_load_block_cost: float = Field(
        1.0,
        gt=0.0,
        description="Estimated cost of loading one block back from the host tier, in prompt "
        "tokens of prefill compute (the swap-or-recompute estimate).",
    )
    admission_watermark: float = Field(
        0.01,
        ge=0.0,
        lt=1.0,
        description="Fraction of blocks kept free when admitting new "
        "requests while others run (fewer preemptions).",
    )
    cache_aware_admission: bool = Field(
        False,
        description="Among the waiting requests of one policy class (one priority level; "
        "every request under fcfs), admit those with the longest prompt prefix cached now "
        "first, so one whose prefix is not cached does not evict the prefix a request behind "
        "it was placed here for. Priorities still win; admission_max_overtakes and "
        "admission_max_wait_s bound how long a request can be passed.",
    )
    admission_max_overtakes: int = Field(
        4,
        ge=0,
        description="Cache-aware admission: most admissions of later requests a waiting "
        "request lets pass; then nothing behind it is admitted before it.",
    )
    admission_max_wait_s: float = Field(
        5.0,
        ge=0.0,
        description="Cache-aware admission: seconds a request may wait before nothing behind "
        "it is admitted before it any more.",
    )
    seed: int = Field(0, ge=0, description="Seed of the RNG used by requests without a seed.")
    log_stats: bool = Field(
        True,
        description="Measure what only metrics need: each finished request's queue, prefill, "
        "decode and inference times, sampled KV blocks' residency, the worker's latency "
        "histograms (vLLM's --disable-log-stats turns its equivalent off). Off: those "
        "series stay at zero.",
    )
    kv_block_sample_stride: int = Field(
        16,
        ge=0,
        description="With log_stats: every that many-th KV block's residency (lifetime, "
        "idle time before eviction, reuse gap) is measured; 1: every block, 0: none.",
    )
    reasoning: Literal["auto", "off"] = Field(
        "auto",
        description="Reasoning models (Qwen3, DeepSeek-R1 and its distills, QwQ: a vocabulary "
        "with <think> and </think> as tokens) think before they answer. auto: a request's "
        "grammar (structured outputs, a required tool call) starts after the reasoning ends, "
        "and the HTTP door answers the reasoning apart from the content (`reasoning`); the "
        "routers take this setting from here. off: the output is one text, constrained "
        "from its first token. A model without the tokens is unaffected.",
    )
    dtype: str = Field("float32", description="Model dtype (runner).")
    device: str = Field("cpu", description="Torch device (runner).")
    attn_backend: str = Field(
        "auto",
        description="Attention backend (runner): auto, torch, cpu, triton or flashinfer "
        "(CUDA, float16/bfloat16, the flashinfer extra); auto picks the fastest usable one "
        "(triton on CUDA, the native cpu kernels on the CPU).",
    )
    cpu_threads: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="torch intra-op threads (and the native CPU kernels' pool) of the "
        "thread that runs the model (the engine loop's, in a worker). None: as torch has them "
        "where the engine is built; in a worker actor that is Ray's choice, the whole CPUs "
        "it reserves (workers.num_cpus_per_worker, at least 1). On CPU, a worker alone on "
        "its node runs fastest with one per core; several workers on one node share its "
        "cores (more threads than cores make every parallel region wait for a descheduled "
        "thread). On CUDA the device computes: 1 is enough.",
    )
    cuda_graphs: bool = Field(
        True,
        description="Replay decode steps from CUDA graphs captured at start-up per batch-size "
        "bucket (CUDA with the triton backend only; ignored elsewhere).",
    )

    max_loras: int = Field(
        DEFAULT_MAX_LORAS,
        ge=1,
        description="LoRA adapter slots on the device: adapters that can run in one batch. "
        "Requests of an adapter that finds every slot used by running requests wait.",
    )
    max_lora_rank: int = Field(
        DEFAULT_MAX_LORA_RANK,
        ge=1,
        description="Largest LoRA rank r served; slots are sized for it.",
    )
    lora_adapters: dict[str, str] = Field(
        default_factory=dict,
        description="LoRA adapters registered at start: name -> PEFT adapter folder "
        "(adapter_config.json + adapter_model.safetensors or .bin). More can be added at run "
        "time.",
    )
    speculative: SpeculativeConfig = Field(
        SpeculativeConfig(), description="Draft-free speculative decoding (off by default)."
    )
    lora_tenants: dict[str, list[str]] = Field(
        default_factory=dict,
        description="Owned adapters: name (of lora_adapters) -> the tenants that may see and "
        "use it; the routers hide it from every other tenant (with router auth_tokens). An "
        "adapter not listed serves every tenant.",
    )

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        SCHEDULING_POLICIES.get(value)  # raises naming the valid ones
        return value

    @model_validator(mode="after")
    def _consistent(self) -> EngineConfig:
        if self.num_blocks is not None and self.kv_memory_bytes is not None:
            raise ValueError("give num_blocks or kv_memory_bytes, not both")
        if self.host_kv_bytes and not self.enable_prefix_caching:
            raise ValueError(
                f"host_kv_bytes={self.host_kv_bytes} needs enable_prefix_caching: the host tier "
                "keeps cached blocks; turn caching on or set host_kv_bytes to 0"
            )
        if self.disk_kv_bytes:
            if not self.disk_kv_path:
                raise ValueError(
                    f"disk_kv_bytes={self.disk_kv_bytes} needs disk_kv_path: the directory of "
                    "the disk KV tier; set it or set disk_kv_bytes to 0"
                )
            if not self.enable_prefix_caching or not self.host_kv_bytes:
                raise ValueError(
                    f"disk_kv_bytes={self.disk_kv_bytes} needs enable_prefix_caching and a host "
                    f"tier (host_kv_bytes={self.host_kv_bytes}, enable_prefix_caching="
                    f"{self.enable_prefix_caching}): the disk tier keeps the blocks the host "
                    "tier evicts; set host_kv_bytes > 0 or disk_kv_bytes to 0"
                )
        for name, tenants in self.lora_tenants.items():
            if name not in self.lora_adapters:
                raise ValueError(
                    f"lora_tenants names adapter {name!r}, which is not in lora_adapters "
                    f"({', '.join(sorted(self.lora_adapters)) or 'none'})"
                )
            check_tenants(name, tenants)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} < max_num_seqs="
                f"{self.max_num_seqs}: every running sequence needs one token per decode step; "
                "raise max_num_batched_tokens or lower max_num_seqs"
            )
        return self

    @property
    def prefill_chunk_cap(self) -> int:
        """Most prompt tokens one request may compute in one step."""
        cap = self.max_num_batched_tokens
        if self.long_prefill_token_threshold is not None:
            cap = min(cap, self.long_prefill_token_threshold)
        return cap

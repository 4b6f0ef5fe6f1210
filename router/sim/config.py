"""Simulator settings: the cluster shape and the per-worker time model.

Default time model: one worker is a 70B-class GQA model (80 layers, d_model 8192, 8 KV
heads of 128, bf16) on an 8-GPU node.
- prefill: 2 x 70e9 FLOP per token plus 4 x d_model x layers = 2.6 MFLOP per (token,
  earlier token) of attention, at 50 % of 8 x 312 TFLOP/s = 1.25 PFLOP/s
  -> 1.1e-4 s per token + 2.1e-9 s per token per context token;
- decode: each step reads the 140 GB of weights at 60 % of 8 x 2 TB/s -> 15 ms, plus
  the sequence's KV, 2 x 80 x 8 x 128 x 2 B = 327 KB per context token -> 3.4e-8 s;
- chunked prefill: a step computes at most 2048 tokens (decodes first, then prefill
  chunks FCFS), at most 128 running sequences.
Every step pays the fixed weight-read cost, prefill chunks and decodes share steps.
- peer pulls (``pull_fixed_s``, ``pull_s_per_token``, when the router prices pulls): a run
  of blocks moves between nodes at 327 KB per token over RDMA at ~50 GB/s effective
  (NIXL-class, one 400 Gb/s NIC) -> 6.5e-6 s per token, plus 2 ms of calls and setup; the
  source pays for reading the blocks out of its KV cache in its next step (HBM, ~1 TB/s
  effective for a gather -> 3.3e-7 s per token), the destination for writing them in
  (the same) in the step that admits the request;
- KV tiers below the device (``tier_load_s_per_token``; the host tier when
  ``host_kv_tokens_per_worker`` > 0): loading a block back from the host tier reads its
  327 KB per token over the node's host links, 8 x PCIe Gen5 at ~25 GB/s effective each
  = 200 GB/s -> 1.6e-6 s per token; from a disk tier, 8 NVMe Gen5 drives at ~6 GB/s each
  = 50 GB/s -> 6.5e-6 s per token; paid in the step that admits the request (not
  overlapped with compute: a conservative bound). Whether a hit is loaded at all is the
  engine's rule (``TierChain.worth_loading``): a disk hit is read only when its load time
  (``tier_load_s_per_token[disk]``) is below recomputing its tokens, which the simulated
  worker estimates as the engine does (:meth:`TimeModel.recompute_s`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from pydantic import Field, field_validator, model_validator

from kvstore.blocks.tiers import HELD_TIERS, Tier
from kvstore.runtime.strict import Strict

# host: 8 x PCIe Gen5 at ~25 GB/s; disk: 8 NVMe Gen5 at ~6 GB/s (the module docstring)
TIER_LOAD_S_PER_TOKEN: dict[Tier, float] = {Tier.HOST: 1.6e-6, Tier.DISK: 6.5e-6}


class TimeModel(Strict):
    """Seconds one worker spends per engine step (see the module docstring)."""

    step_overhead_s: float = Field(0.015, ge=0, description="Fixed cost of every step.")
    prefill_s_per_token: float = Field(1.1e-4, ge=0, description="Per uncached prompt token.")
    attn_s_per_token_pair: float = Field(
        2.1e-9, ge=0, description="Per (prompt token computed, earlier token it attends to)."
    )
    decode_s_per_ctx_token: float = Field(
        3.4e-8, ge=0, description="Per context token of each decoding sequence, per step."
    )
    tier_load_s_per_token: dict[Tier, float] = Field(
        default_factory=lambda: dict(TIER_LOAD_S_PER_TOKEN),
        description="Per KV tier below the device, loading one token's KV back from it "
        "(bandwidth); a tier not given keeps its default (host 1.6e-6, disk 6.5e-6).",
    )
    lora_load_s: float = Field(
        0.02,
        ge=0,
        description="Loading a LoRA adapter into a device slot (r=16 on all seven "
        "projections of a 70B model is ~0.4 GB from host memory).",
    )
    pull_fixed_s: float = Field(0.002, ge=0, description="Fixed cost of one peer pull.")
    pull_s_per_token: float = Field(
        6.5e-6, ge=0, description="Moving one token's KV between two workers (bandwidth)."
    )
    pull_copy_s_per_token: float = Field(
        3.3e-7,
        ge=0,
        description="Gathering one token's KV out of (or into) a KV cache, charged to the "
        "source's next step and to the admitting step of the destination.",
    )
    max_batched_tokens: int = Field(2048, ge=1, description="Token budget of one step.")
    max_running: int = Field(128, ge=1, description="Sequences in the running batch at most.")

    @field_validator("tier_load_s_per_token")
    @classmethod
    def _lower_tiers(cls, value: dict[Tier, float]) -> dict[Tier, float]:
        for tier, seconds in value.items():
            if tier not in HELD_TIERS[1:] or seconds < 0:
                lower = ", ".join(HELD_TIERS[1:])
                raise ValueError(
                    f"tier_load_s_per_token[{tier}] = {seconds}: give seconds >= 0 for {lower}"
                )
        return {**TIER_LOAD_S_PER_TOKEN, **value}

    def load_s(self, tier_tokens: Mapping[Tier, int]) -> float:
        """Loading the tokens found in each lower tier back to the device."""
        return sum(n * self.tier_load_s_per_token[t] for t, n in tier_tokens.items())

    def recompute_s(self, n: int) -> float:
        """What recomputing ``n`` prompt tokens costs as the engine prices it against a
        lower-tier read (``KVCacheManager(recompute_seconds=...)``): its measured prefill rate,
        tokens over seconds of forward (:class:`~worker.engine.prefill_rate.PrefillRate`),
        here the per-token prefill cost."""
        return n * self.prefill_s_per_token

    def prefill_s(self, start: int, n: int) -> float:
        """Compute time of prompt tokens ``start .. start+n-1`` (attending to all before)."""
        pairs = n * start + n * (n - 1) // 2
        return n * self.prefill_s_per_token + pairs * self.attn_s_per_token_pair

    def idle_ttft_s(
        self, prompt: int, cached: int, tier_cached: Mapping[Tier, int] | None = None
    ) -> float:
        """TTFT of a prompt alone on an idle worker: its prefill steps (chunks of the token
        budget after the ``cached`` prefix, each paying the step overhead; one step if all of
        it is cached) plus loading the ``tier_cached`` tokens of each lower tier back. No
        scheduler beats it."""
        steps, pos, busy = 0, cached, 0.0
        while pos < prompt:
            n = min(self.max_batched_tokens, prompt - pos)
            busy += self.prefill_s(pos, n)
            pos += n
            steps += 1
        return max(steps, 1) * self.step_overhead_s + busy + self.load_s(tier_cached or {})


class SimConfig(Strict):
    """The simulated cluster."""

    num_workers: int = Field(8, ge=1, description="Workers, each with its own KV manager.")
    kv_tokens_per_worker: int = Field(
        3_100_000, ge=1, description="KV cache capacity per worker, in tokens (LRU beyond it)."
    )
    host_kv_tokens_per_worker: int = Field(
        0,
        ge=0,
        description="Host-memory KV tier per worker, in tokens (0 = none): blocks evicted from "
        "the device are kept there (LRU) and loaded back on a prefix hit.",
    )
    disk_kv_tokens_per_worker: int = Field(
        0,
        ge=0,
        description="Disk KV tier per worker, in tokens (0 = none), below the host tier: "
        "blocks the host tier evicts are written there (LRU over what was written or read) and "
        "read back on a prefix hit when that beats recomputing them. Needs a host tier.",
    )
    disk_admit_after: Literal[1, 2] = Field(
        1,
        description="Write a block to the disk tier the first time the host tier evicts it "
        "(1) or only the second time (2), as the engine's disk_kv_admit_after.",
    )
    block_size: int = Field(16, ge=1, description="Tokens per KV block (engine and router).")
    event_delay_s: float = Field(
        0.1, ge=0, description="Delay from a worker's step end until its KV events reach the index."
    )
    waiting_load: Literal["uncached", "whole"] = Field(
        "uncached",
        description="What a worker's heartbeat counts as queued prefill for a request still "
        "waiting for admission. 'uncached': its prompt minus the prefix the worker already "
        "caches (what it will compute), as the engine's Scheduler.pending_prefill_tokens "
        "reports it. 'whole': its whole prompt (the naive rule, for comparison); it overstates the "
        "queue of a worker that holds the waiting prompts' prefixes, which makes "
        "prefix_affinity avoid its holders.",
    )
    max_loras: int = Field(
        8,
        ge=1,
        description="LoRA adapter slots per worker (LRU); a request whose adapter is "
        "not in one pays time.lora_load_s at admission.",
    )
    time: TimeModel = TimeModel()

    @model_validator(mode="after")
    def _disk_below_host(self) -> SimConfig:
        if self.disk_kv_tokens_per_worker and not self.host_kv_tokens_per_worker:
            raise ValueError(
                f"disk_kv_tokens_per_worker={self.disk_kv_tokens_per_worker} needs "
                "host_kv_tokens_per_worker > 0 (got 0): the disk tier keeps the blocks the host "
                "tier evicts; set both or disk_kv_tokens_per_worker to 0"
            )
        return self

"""LoRA adapters in routing: id resolution, eligible workers, the adapter-load term, keys."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace

import pytest

from kvstore.index_types import WorkerLoad
from kvstore.requests.outputs import CompletionDelta, FinishReason
from kvstore.requests.protocol import Admitted, WorkerRequest, WorkerStatus
from router.placement.adapters import resolve_adapter, serving
from router.placement.config import RoutingConfig
from router.placement.placement_types import RouteRequest
from router.placement.router import Router
from router.serving.core import ModelLimits, ServingCore
from router.serving.workers import WorkerDirectory
from worker.engine import InvalidRequest, RequestOutput, SamplingParams, Usage
from worker.kv import HashContext, block_keys

IDLE = WorkerLoad(running=0, waiting=0, free_blocks=100, total_blocks=100, queued_prefill_tokens=0)
A1, A2 = "a1@00000000000000aa", "a2@00000000000000bb"
LOADS = {
    "w0": replace(IDLE, lora_ids=(A1, A2), lora_loaded=(A1,)),
    "w1": replace(IDLE, lora_ids=(A1, A2), lora_loaded=(A2,)),
    "w2": IDLE,  # serves no adapter
}
PROMPT = list(range(10, 74))  # 4 blocks of 16


def test_resolve_names_the_unknown_adapter_and_lists_the_served() -> None:
    assert resolve_adapter("a1", LOADS) == A1
    with pytest.raises(InvalidRequest, match="'nope'.*unknown adapter.*a1, a2"):
        resolve_adapter("nope", LOADS)
    with pytest.raises(InvalidRequest, match="serve: none"):
        resolve_adapter("a1", {"w2": IDLE})
    # workers disagree (a re-registration rolling out): the majority's id
    newer = "a1@00000000000000cc"
    mixed = {**LOADS, "w2": replace(IDLE, lora_ids=(newer,))}
    assert resolve_adapter("a1", mixed) == A1


def test_only_workers_serving_the_adapter_are_candidates() -> None:
    assert sorted(serving(A1, LOADS)) == ["w0", "w1"]
    assert sorted(serving(None, LOADS)) == ["w0", "w1", "w2"]


def route(router: Router, adapter_id: str | None, loads=LOADS, rid: str = "r") -> str:
    req = RouteRequest(rid, PROMPT, HashContext("m", adapter_id))
    return router.route(req, serving(adapter_id, loads)).worker_id


def test_the_worker_holding_the_adapter_wins_at_equal_load() -> None:
    router = Router(RoutingConfig(pending_ttl_s=0), block_size=16)
    assert route(router, A1) == "w0"
    assert route(router, A2) == "w1"
    # the load term outweighs the adapter-load term: a hot adapter spreads
    busy = {**LOADS, "w0": replace(LOADS["w0"], queued_prefill_tokens=1000)}
    assert route(router, A1, busy) == "w1"


def test_router_keys_carry_the_adapter_and_blind_routing_drops_it() -> None:
    aware = Router(RoutingConfig(), block_size=16)
    blind = Router(RoutingConfig(adapter_aware=False), block_size=16)
    req = RouteRequest("r", PROMPT, HashContext("m", A1))
    keys = aware.route(req, LOADS).keys
    assert keys == tuple(block_keys(PROMPT, 16, HashContext("m", A1)))
    assert set(keys).isdisjoint(block_keys(PROMPT, 16, HashContext("m", A2)))
    assert set(keys).isdisjoint(block_keys(PROMPT, 16, HashContext("m")))
    assert blind.route(req, LOADS).keys == tuple(block_keys(PROMPT, 16, HashContext("m")))


class Workers(WorkerDirectory):
    """Fixed heartbeats; each stream answers one token at once."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, WorkerRequest]] = []

    async def candidates(self) -> Mapping[str, WorkerLoad]:
        return LOADS

    async def stream(
        self, worker_id: str, request: WorkerRequest
    ) -> AsyncIterator[Admitted | RequestOutput]:
        self.requests.append((worker_id, request))
        yield Admitted(worker_id, 1, None)
        delta = CompletionDelta(0, "x", [7], finish_reason=FinishReason.LENGTH)
        yield RequestOutput(request.request_id, [delta], True, Usage(len(request.token_ids), 0, 1))

    async def abort(self, worker_id: str, request_id: str) -> None:
        return None

    async def statuses(self) -> list[WorkerStatus]:
        return []


def test_serving_core_routes_by_adapter_and_rejects_unknown_ones() -> None:
    async def main(directory: Workers) -> None:
        core = ServingCore(
            Router(RoutingConfig(pending_ttl_s=0), block_size=16),
            directory,
            ModelLimits("m", 1000, 4096, 4095),
        )
        for i, name in enumerate(["a2", "a1", "a2"]):
            async for _ in core.generate(f"r{i}", PROMPT, SamplingParams(lora=name)):
                pass
        with pytest.raises(InvalidRequest, match="nope"):
            async for _ in core.generate("bad", PROMPT, SamplingParams(lora="nope")):
                pass
        core.close()

    directory = Workers()
    asyncio.run(main(directory))
    assert [(w, r.params.lora) for w, r in directory.requests] == [
        ("w1", "a2"),
        ("w0", "a1"),
        ("w1", "a2"),
    ]


def test_heartbeat_carries_adapters_and_grpc_field_maps_to_params() -> None:
    import json

    from protos.kvcluster.v1 import kvcluster_pb2 as pb
    from router.edge.convert import spec_from_pb

    load = LOADS["w0"]
    assert WorkerLoad.from_dict(json.loads(json.dumps(load.to_dict()))) == load
    assert (
        WorkerLoad.from_dict(
            {
                "running": 1,
                "waiting": 0,
                "free_blocks": 1,
                "total_blocks": 1,
                "queued_prefill_tokens": 0,
            }
        ).lora_ids
        == ()
    )
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]), lora="a1")
    assert spec_from_pb(req).params.lora == "a1"
    assert spec_from_pb(pb.GenerateRequest(text="hi")).params.lora is None
    with pytest.raises(InvalidRequest, match="lora"):
        spec_from_pb(pb.GenerateRequest(text="hi", lora="x" * 65))


def test_sim_worker_charges_adapter_loads_and_reports_its_slots() -> None:
    from router.sim import SimRequest, SimWorker, TimeModel
    from worker.kv import KVCacheManager

    tm = TimeModel(
        step_overhead_s=0.01,
        prefill_s_per_token=0.001,
        attn_s_per_token_pair=0.0,
        decode_s_per_ctx_token=0.0,
        max_batched_tokens=64,
        lora_load_s=0.5,
    )
    worker = SimWorker("w0", KVCacheManager(64, 16), tm, max_loras=1)
    ctx = {a: HashContext("m", a) for a in (A1, A2)}
    first = worker.submit(SimRequest("r1", 0.0, list(range(10, 30)), 1, ctx[A1]), 0, ())
    worker.advance(10.0)
    assert first.first_token_s == pytest.approx(0.01 + 0.02 + 0.5)  # step + prefill + load
    assert worker.load(10.0).lora_loaded == (A1,)
    again = worker.submit(SimRequest("r2", 10.0, list(range(40, 60)), 1, ctx[A1]), 0, ())
    worker.advance(20.0)
    assert again.first_token_s - 10.0 == pytest.approx(0.03)  # in its slot: no load
    worker.submit(SimRequest("r3", 20.0, list(range(70, 90)), 1, ctx[A2]), 0, ())
    worker.advance(30.0)
    assert worker.load(30.0).lora_loaded == (A2,) and worker.lora_loads == 2


OWNED = {  # A1 is alice's on both workers; A2 is for every tenant
    "w0": replace(LOADS["w0"], lora_owners=(f"{A1}=alice",)),
    "w1": replace(LOADS["w1"], lora_owners=(f"{A1}=alice",)),
    "w2": IDLE,
}


def test_an_owned_adapter_exists_for_its_tenants_only() -> None:
    from router.placement.adapters import for_tenant

    alice, bob, anon = (for_tenant(OWNED, t) for t in ("alice", "bob", None))
    assert resolve_adapter("a1", alice) == A1 and resolve_adapter("a2", bob) == A2
    for view in (bob, anon):  # the others: as unknown as a name nobody serves
        with pytest.raises(InvalidRequest, match="'a1'.*unknown adapter; live workers serve: a2$"):
            resolve_adapter("a1", view)
        assert view["w0"].lora_ids == (A2,) and view["w0"].lora_loaded == ()
    assert sorted(serving(A1, alice)) == ["w0", "w1"]
    assert for_tenant(LOADS, "bob") == LOADS  # nothing owned: every view is the same
    # the owners travel with the heartbeat
    import json

    assert WorkerLoad.from_dict(json.loads(json.dumps(OWNED["w0"].to_dict()))) == OWNED["w0"]


def test_serving_core_refuses_another_tenants_adapter() -> None:
    class Owned(Workers):
        async def candidates(self) -> Mapping[str, WorkerLoad]:
            return OWNED

    async def main(directory: Workers) -> None:
        core = ServingCore(
            Router(RoutingConfig(pending_ttl_s=0), block_size=16),
            directory,
            ModelLimits("m", 1000, 4096, 4095),
        )
        async for _ in core.generate("r0", PROMPT, SamplingParams(lora="a1"), tenant="alice"):
            pass
        for tenant in ("bob", None):
            with pytest.raises(InvalidRequest, match="'a1'.*unknown adapter"):
                async for _ in core.generate(
                    "r1", PROMPT, SamplingParams(lora="a1"), tenant=tenant
                ):
                    pass
        core.close()

    directory = Owned()
    asyncio.run(main(directory))
    assert [(w, r.params.lora) for w, r in directory.requests] == [("w0", "a1")]

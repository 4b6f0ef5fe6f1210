"""Peer pulls between real worker actors on a real local Ray: a pulled prefix gives the
recomputed tokens; a frozen-then-killed source, a forged run and another tenant's keys all
end in a recompute, never a failure or a hang; no block or object is left behind."""

from __future__ import annotations

import os
import random
import signal
import time
from dataclasses import replace

import pytest
import ray

from kvstore.blocks.hashing import block_keys
from kvstore.blocks.protocol import Admitted, PullHint, WorkerRequest
from kvstore.blocks.sampling_params import SamplingParams
from tests.embedded_ray import shared_ray
from tests.pull.streams import generate, receive, send
from worker.actor import WorkerActor, WorkerSettings
from worker.engine import EngineConfig
from worker.engine.commands import ResetPrefixCache
from worker.model.build_tiny import build_tiny_model

pytestmark = pytest.mark.ray

BS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def ray_ns(tmp_path_factory: pytest.TempPathFactory):
    """The session's Ray (the workers are named in its job's namespace) and a model."""
    shared_ray()
    return build_tiny_model(tmp_path_factory.mktemp("pull") / "llama", "llama")


def start(model_dir, name: str):
    settings = WorkerSettings(
        worker_id=name,
        model_dir=str(model_dir),
        model_id="tiny",
        engine=EngineConfig(block_size=BS, num_blocks=64, max_model_len=512),
        index=None,
    )
    actor = WorkerActor.options(name=name, num_cpus=0, max_restarts=0).remote(settings)
    ray.get(actor.ready.remote(), timeout=120)
    return actor


def prompt(seed: int, n: int = 90) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def run(actor, req: WorkerRequest) -> tuple[Admitted, list[int], int]:
    """One request through a channel of its own: its Admitted, tokens and cached tokens."""
    return generate(actor, req)


def hint(source: str, n_blocks: int, deadline_s: float = 10.0) -> PullHint:
    return PullHint(source, 0, n_blocks, deadline_s)


def test_pull_across_workers_equals_recompute_and_leaves_nothing(ray_ns) -> None:
    a, b, c = (start(ray_ns, f"worker-p{i}") for i in range(3))
    p = prompt(1)
    _, want, _ = run(a, WorkerRequest("r1", p, GREEDY))  # a computes and caches p
    _, recomputed, cached = run(c, WorkerRequest("r2", p, GREEDY))
    assert recomputed == want and cached == 0
    adm, got, cached = run(b, WorkerRequest("r3", p, GREEDY, pull=hint("worker-p0", 5)))
    assert adm.pulled is not None and adm.pulled.outcome == "ok", adm.pulled
    assert adm.pulled.blocks == 5 and adm.pulled.tokens == 80 and adm.pulled.nbytes > 0
    assert got == want and cached == 80  # ran as a prefix hit of the pulled blocks
    for w in (a, b, c):
        assert ray.get(w.kv_blocks_in_use.remote()) == 0
    assert ray.get(a.pull_stats.remote())["exported_runs"] == 1
    # a pull of a prefix the source does not hold, from a worker that does not exist, or
    # of another tenant's blocks: recomputed, the same tokens
    for i, src in enumerate(["worker-p0", "worker-nobody", "worker-p2"]):
        q = prompt(10 + i)
        _, want_q, _ = run(c, WorkerRequest(f"r4-{i}", q, GREEDY))  # c holds q, unsalted
        params = replace(GREEDY, cache_salt="tenant-b") if i == 2 else GREEDY
        adm, got, cached = run(b, WorkerRequest(f"r5-{i}", q, params, pull=hint(src, 5)))
        assert adm.pulled.outcome == ("source-gone" if i == 1 else "missing"), adm.pulled
        assert got == want_q and cached == 0
    for w in (a, b, c):
        ray.kill(w)


def test_source_frozen_then_killed_mid_export_falls_back_to_recompute(ray_ns) -> None:
    a, b = start(ray_ns, "worker-k0"), start(ray_ns, "worker-k1")
    p = prompt(3)
    _, want, _ = run(a, WorkerRequest("k1", p, GREEDY))
    pid = ray.get(a.__ray_call__.remote(lambda _: os.getpid()))
    os.kill(pid, signal.SIGSTOP)  # the export call now hangs: the deadline must end it
    try:
        t0 = time.monotonic()
        adm, got, cached = run(b, WorkerRequest("k2", p, GREEDY, pull=hint("worker-k0", 5, 1.0)))
        assert adm.pulled.outcome == "timeout" and time.monotonic() - t0 < 30
        assert got == want and cached == 0
        # killed while its export is in flight: the call fails fast, recomputed again
        req = WorkerRequest("k3", p, replace(GREEDY, seed=1), pull=hint("worker-k0", 5, 30.0))
        sent = send(b, req)
        time.sleep(0.5)
        os.kill(pid, signal.SIGKILL)
        adm, outs = receive(sent, 60)
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert isinstance(adm, Admitted) and adm.pulled.outcome == "source-gone", adm.pulled
    assert adm.pulled.seconds < 25
    assert [t for out in outs for d in out.outputs for t in d.token_ids] == want
    assert ray.get(b.kv_blocks_in_use.remote()) == 0
    assert ray.get(b.pull_stats.remote())["outcomes"] == {"timeout": 1, "source-gone": 1}
    ray.kill(b)


@ray.remote(num_cpus=0)
class ForgingPeer:
    """Answers every export with a genuine run of another prompt, relabelled with the keys
    it was asked for (or with a payload of the wrong size): what a buggy or hostile peer
    could send."""

    def __init__(self, honest, other_prompt: list[int], mode: str) -> None:
        self.honest, self.other, self.mode = honest, other_prompt, mode

    async def export_kv(self, keys, ctx, start=0):
        from worker.pull.transport import RayObjectStoreTransport

        handle = await self.honest.export_kv.remote(block_keys(self.other, BS, ctx), ctx, 0)
        run_ = await handle.ref
        n = len(keys)
        header = replace(run_.header, keys=tuple(keys), token_ids=run_.header.token_ids[:n])
        if self.mode == "wrong-size":
            header = replace(header, token_ids=header.token_ids + header.token_ids)
        return RayObjectStoreTransport().publish(replace(run_, header=header))


def test_forged_run_from_a_peer_is_refused(ray_ns) -> None:
    a, b = start(ray_ns, "worker-f0"), start(ray_ns, "worker-f1")
    p, other = prompt(4), prompt(5, 120)
    run(a, WorkerRequest("f1", other, GREEDY))
    _, want, _ = run(a, WorkerRequest("f2", p, GREEDY))
    for i, mode in enumerate(["relabelled", "wrong-size"]):
        evil = ForgingPeer.options(name=f"worker-evil{i}").remote(a, other, mode)
        ray.get(evil.__ray_ready__.remote(), timeout=60)
        adm, got, cached = run(
            b, WorkerRequest(f"f3-{i}", p, GREEDY, pull=hint(f"worker-evil{i}", 5))
        )
        assert adm.pulled.outcome == "refused" and adm.pulled.blocks == 0, adm.pulled
        assert got == want and cached == 0
        ray.get(b.__ray_call__.remote(lambda w: w.engine_loop.call(ResetPrefixCache())))
    assert ray.get(b.kv_blocks_in_use.remote()) == 0
    assert ray.get(b.pull_stats.remote())["outcomes"] == {"refused": 2}
    for w in (a, b):
        ray.kill(w)


def test_warm_start_pulls_a_peers_hottest_prefixes(ray_ns) -> None:
    """A new worker pulls the prefixes its peer served most; its first requests for them
    are prefix hits with the tokens the peer computed."""
    a, b = start(ray_ns, "worker-w0"), start(ray_ns, "worker-w1")
    hot, cold = [prompt(20 + i) for i in range(3)], prompt(30)
    want = {}
    for i, p in enumerate(hot):
        for j in range(2):  # served twice: hotter than the cold one
            _, toks, _ = run(a, WorkerRequest(f"h{i}-{j}", p + [j + 3], GREEDY))
            want.setdefault(i, toks)  # the outputs of p + [3]
    run(a, WorkerRequest("c", cold, GREEDY))
    done = ray.get(b.warm_start.remote(["worker-w0", "worker-nobody"], 3), timeout=120)
    assert done == {"runs": 3, "blocks": 15, "skipped": 1}, done
    for i, p in enumerate(hot):
        _, got, cached = run(b, WorkerRequest(f"b{i}", p + [3], GREEDY))
        assert cached == 80 and got == want[i], (i, cached)
    _, _, cached = run(b, WorkerRequest("bc", cold, GREEDY))
    assert cached == 0  # not among the 3 hottest
    assert ray.get(b.kv_blocks_in_use.remote()) == 0
    for w in (a, b):
        ray.kill(w)

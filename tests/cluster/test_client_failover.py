"""A client given several router addresses spreads its calls over them and moves a call that
failed before any answer to the next address; a stream that delivered tokens is not replayed
(real gRPC servers in their own processes, killed as a router's node is)."""

from __future__ import annotations

import time

import grpc
import pytest

from cluster.client import KVClusterClient, build_request, router_targets
from tests.cluster.stub_router import StubProcess, free_port


@pytest.fixture
def routers():
    procs = [StubProcess(free_port()) for _ in range(3)]
    yield procs
    for p in procs:
        p.close()


def test_targets_are_split_unless_grpc_balances_them() -> None:
    assert router_targets("a:1, b:2,c:3") == ["a:1", "b:2", "c:3"]
    assert router_targets(["a:1", "b:2"]) == ["a:1", "b:2"]
    assert router_targets("ipv4:127.0.0.1:1,127.0.0.1:2") == ["ipv4:127.0.0.1:1,127.0.0.1:2"]
    assert router_targets("[::1]:50051") == ["[::1]:50051"]
    with pytest.raises(ValueError, match="no router address"):
        router_targets(" , ")


def test_calls_take_turns_over_the_routers(routers) -> None:
    with KVClusterClient([r.address for r in routers]) as client:
        served = {client.generate("x", max_tokens=1, timeout=10).worker_id for _ in range(6)}
    assert served == {f"stub-{r.port}" for r in routers}


def test_every_call_fails_over_from_dead_routers(routers) -> None:
    routers[0].kill()
    routers[1].kill()
    live = f"stub-{routers[2].port}"
    with KVClusterClient(",".join(r.address for r in routers)) as client:
        for _ in range(4):  # each starting at another address
            assert client.generate("x", max_tokens=2, timeout=10).worker_id == live
            assert client.unary("x", timeout=10).worker_id == live


def test_a_stream_whose_router_dies_is_resumed_not_replayed(routers) -> None:
    with KVClusterClient([r.address for r in routers]) as client:
        call = client.stream(build_request("x", max_tokens=60), timeout=30)
        msgs = [next(call) for _ in range(5)]
        victim = next(r for r in routers if f"stub-{r.port}" == msgs[0].worker_id)
        victim.kill()
        msgs += list(call)
    tokens = [t for m in msgs for t in m.token_ids]
    assert tokens == list(range(60))  # no gap, no duplicate
    assert msgs[-1].worker_id != msgs[0].worker_id  # finished by another router


def test_a_stream_of_several_samples_is_not_resumed(routers) -> None:
    with KVClusterClient([r.address for r in routers]) as client:
        call = client.stream(build_request("x", max_tokens=10_000, n=2), timeout=30)
        first = next(call)
        victim = next(r for r in routers if f"stub-{r.port}" == first.worker_id)
        victim.kill()
        with pytest.raises(grpc.RpcError) as err:
            for msg in call:
                assert msg.worker_id == first.worker_id
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_all_routers_dead_fails_unavailable_soon(routers) -> None:
    for r in routers:
        r.kill()
    with KVClusterClient([r.address for r in routers]) as client:
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            client.generate("x", timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - t0 < 5  # 4 attempts, one back-off round: not the timeout


def test_cli_and_load_generator_take_every_router(routers, capsys) -> None:
    import io

    from benchmarks.loadgen import run_bench
    from cluster.cli import main

    routers[0].kill()
    target = ",".join(r.address for r in routers)
    assert main(["generate", "x", "--target", target, "--max-tokens", "3"]) == 0
    assert "0 1 2 " in capsys.readouterr().out
    out = io.StringIO()
    figures = run_bench(target, num_requests=6, concurrency=3, max_tokens=2, plot=False, out=out)
    assert figures["ok"] == 6, out.getvalue()
    for r in routers[1:]:
        assert f"stub-{r.port}" in out.getvalue()  # both live routers served

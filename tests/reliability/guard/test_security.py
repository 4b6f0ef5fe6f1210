"""Security: TLS + bearer tokens, tenant isolation of the KV cache and of routing signals,
and no secret in any log.

The tenant's salt is folded into block 0's key on the worker and in the index, so the same
prompt from two tenants shares no KV block and no index entry, whichever comes first, and
a client cannot pick another tenant's salt through ``cache_salt``.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.client import KVClusterClient
from kvstore.index import KVIndex
from router.serving.generate_spec import tenant_salt
from tests.reliability.guard.conftest import REDIS_PASSWORD, TOKENS, connect
from tests.reliability.helpers import CALL_TIMEOUT_S, code_of, wait_for
from worker.kv import HashContext, block_keys

pytestmark = [pytest.mark.ray, pytest.mark.redis]

SHARED = (
    "Confidential: the merger of Acme and Globex closes on Friday; the price is 42 per "
    "share and the board meets at nine. Summarise the risks. "
)


def _keys(cluster, client: KVClusterClient, prompt: str, tenant: str) -> list:  # noqa: ANN001
    ctx = HashContext(cluster.model_id, None, tenant_salt(tenant, ""))
    return block_keys(client.tokenize(prompt), cluster.cfg.workers.engine.block_size, ctx)


def _ask(client: KVClusterClient, prompt: str, **kwargs: object):  # noqa: ANN202
    return client.generate(prompt, max_tokens=2, temperature=0.0, timeout=CALL_TIMEOUT_S, **kwargs)


@pytest.mark.parametrize(("first", "second"), [("alice", "bob"), ("bob", "alice")])
def test_tenants_share_no_cache_and_no_routing_signal(secure, tls, first, second) -> None:
    prompt = f"(Asked first by {first}.) {SHARED}"  # no block in common with the other case
    index = KVIndex(secure.index_config())
    with connect(secure, tls, first) as a, connect(secure, tls, second) as b:
        warm = _ask(a, prompt)
        assert wait_for(lambda: any(index.lookup(_keys(secure, a, prompt, first)).values()), 30)
        again = _ask(a, prompt)
        assert again.cached_tokens > 0  # the owner hits its own cache
        # the other tenant's keys for the very same tokens: nobody holds them
        assert not any(index.lookup(_keys(secure, b, prompt, second)).values())
        other = _ask(b, prompt)
        assert other.cached_tokens == 0, (warm.worker_id, other.worker_id)
        # a client-chosen cache_salt equal to the owner's salt does not cross either
        forged = _ask(b, prompt + " ", cache_salt=tenant_salt(first, ""))
        assert forged.cached_tokens == 0
    index.close()


def test_one_tenant_cannot_flush_anothers_cached_prefix(secure, tls) -> None:
    """Bob streams distinct prompts worth more KV blocks than both workers hold; with the
    per-tenant quota (a quarter of each cache) only his own idle blocks are evicted, so
    Alice's system prompt is still cached afterwards and the workers report the evictions.
    Half of Bob's requests carry a cache_salt of their own: all his salts share his quota."""
    prompt = "Alice's standing instructions: " + "answer briefly and cite the ledger. " * 6
    with connect(secure, tls, "alice") as a, connect(secure, tls, "bob") as b:
        first = _ask(a, prompt + "Q1?")
        pool = secure.cfg.workers.engine.num_blocks * len(secure.workers)
        n = 0
        while n * 6 < 1.5 * pool:  # ~6 full blocks of 16 tokens each
            salt = f"bob-{n}" if n % 2 else ""
            _ask(b, f"Bob's unrelated request {n}: " + f"token{n} " * 40, cache_salt=salt)
            n += 1
        again = _ask(a, prompt + "Q2?")
        assert again.worker_id == first.worker_id and again.cached_tokens >= 96, again
        workers = a.status().workers
    assert sum(w.tenant_quota_evictions for w in workers) > 0


def test_tls_and_bearer_tokens(secure, tls) -> None:
    for token, expected in [
        (None, grpc.StatusCode.UNAUTHENTICATED),
        ("not-a-token", grpc.StatusCode.UNAUTHENTICATED),
        (TOKENS["bob"][:-1], grpc.StatusCode.UNAUTHENTICATED),
        (TOKENS["alice"], grpc.StatusCode.OK),
    ]:
        with connect(secure, tls, None, token=token or "") as c:
            code, details = code_of(lambda c=c: _ask(c, "Who am I?"))
            assert code == expected, (token, code, details)
            code, _ = code_of(lambda c=c: c.status())
            assert code == expected
    # plaintext to a TLS port: the handshake fails, nothing is served
    with KVClusterClient(secure.endpoints[0], token=TOKENS["alice"]) as plain:
        code, _ = code_of(lambda: plain.generate("hi", max_tokens=1, timeout=10))
        assert code == grpc.StatusCode.UNAVAILABLE
    # health probes carry no token and still answer
    with connect(secure, tls, None, token="") as anon:
        reply = health_pb2_grpc.HealthStub(anon.channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=CALL_TIMEOUT_S
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_secrets_never_logged(secure, tls, redis_server, log_records) -> None:
    # make the components log: a Redis outage (workers and routers warn), failed logins
    with connect(secure, tls, None, token="wrong-" + TOKENS["alice"]) as c:
        assert code_of(lambda: _ask(c, "let me in"))[0] == grpc.StatusCode.UNAUTHENTICATED
    redis_server.stop()
    with connect(secure, tls, "alice") as c:
        assert _ask(c, "Served while Redis is down.").completion_tokens == 2
        # the actors' own warnings reach Ray's session log files (written by their processes)
        assert wait_for(lambda: b"index unavailable" in _session_logs(), 30, 0.5)
        redis_server.start()
        assert wait_for(lambda: c.status().index_available, 30, 0.3)
    text = _session_logs()
    secrets = [REDIS_PASSWORD, *TOKENS.values()]
    for secret in secrets:
        assert secret.encode() not in text, "a secret is in Ray's session logs"
        assert not any(secret in line for line in log_records.lines), "a secret was logged"
    assert log_records.lines  # the driver's records were captured


def _session_logs() -> bytes:
    """Every file of Ray's session log folder (the actors' logs), joined."""
    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    return b"".join(p.read_bytes() for p in logs.rglob("*") if p.is_file())

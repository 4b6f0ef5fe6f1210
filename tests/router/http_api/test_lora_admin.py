"""vLLM's run-time LoRA routes at the HTTP door (real uvicorn, the ``openai`` client's raw
POSTs, a real redis-server holding the adapter registry, a scripted fleet of workers that
load, refuse and unload adapters as engines do): every worker loads it, the registry keeps it
for workers that start later, a refused folder is undone everywhere, tenants own theirs,
the cluster config's stay, and the routes are off unless ``router.runtime_lora``."""

from __future__ import annotations

import http.client
import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import pytest

from kvstore.adapter_registry import AdapterRegistry, RegisteredAdapter
from kvstore.config import IndexConfig, make_client
from kvstore.index_types import WorkerLoad
from router.serving.auth import TokenAuth
from tests.router.edges import with_openai
from tests.router.http_api.test_http_hostile_bodies import Core as OneTokenCore
from tests.router.http_api.test_http_hostile_bodies import Tokenizer

pytestmark = pytest.mark.redis
TOKENS = {"alice": "tok-a", "bob": "tok-b"}


@dataclass
class Answer:
    status_code: int
    text: str

    def json(self) -> Any:
        return json.loads(self.text)


class Worker:
    """An engine's adapter table: names -> (folder, tenants); ``/bad`` folders are refused,
    config adapters cannot be removed."""

    def __init__(self, config: dict[str, str]) -> None:
        self.config = dict(config)
        self.adapters = {n: (p, None) for n, p in config.items()}

    def add_lora(self, name: str, path: str, tenants: list[str] | None) -> str:
        if path.startswith("/bad"):
            raise ValueError(f"{path}/adapter_config.json not found")
        self.adapters[name] = (path, tuple(tenants) if tenants is not None else None)
        return f"{name}@{abs(hash(path)) % 10**8}"

    def remove_lora(self, name: str) -> bool:
        if name in self.config:
            raise ValueError(f"adapter {name!r} is registered by the cluster config")
        return self.adapters.pop(name, None) is not None

    def load(self) -> WorkerLoad:
        ids = tuple(f"{n}@{abs(hash(p)) % 10**8}" for n, (p, _) in self.adapters.items())
        owners = tuple(
            f"{n}@{abs(hash(p)) % 10**8}={t}"
            for n, (p, ts) in self.adapters.items()
            for t in ts or ()
        )
        return WorkerLoad(0, 0, 10, 10, 0, lora_ids=ids, lora_owners=owners)


class Fleet:
    """The directory over the workers: their loads, and a call on every one."""

    def __init__(self, workers: dict[str, Worker]) -> None:
        self.workers = workers
        self.calls: list[tuple[str, tuple]] = []

    async def candidates(self) -> dict[str, WorkerLoad]:
        return {w: worker.load() for w, worker in self.workers.items()}

    async def statuses(self) -> list:
        return []

    async def every_worker(self, method: str, *args: Any, timeout_s: float) -> dict[str, Any]:
        self.calls.append((method, args))
        out: dict[str, Any] = {}
        for w, worker in self.workers.items():
            try:
                out[w] = getattr(worker, method)(*args)
            except Exception as exc:  # noqa: BLE001 - delivered as Ray delivers it
                out[w] = exc
        return out


class Core(OneTokenCore):
    def __init__(self, fleet: Fleet) -> None:
        self.directory = fleet


@pytest.fixture
def registry(redis_server: Any) -> AdapterRegistry:
    config = IndexConfig(url=redis_server.url, cluster="c", model_id="m", socket_timeout_s=2.0)
    client = make_client(config)
    client.delete(config.namespace + "loras")
    return AdapterRegistry(client, config.namespace)


def served(
    fleet: Fleet, registry: AdapterRegistry | None, calls: Any, *, on: bool = True, **kw: Any
) -> Any:
    def ask(client: Any) -> Any:
        url = urlsplit(str(client.base_url))

        def post(path: str, body: dict, token: str | None = None) -> Answer:
            headers = {"content-type": "application/json"}
            if token:
                headers["authorization"] = f"Bearer {token}"
            conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
            try:
                conn.request("POST", path, json.dumps(body), headers)
                resp = conn.getresponse()
                return Answer(resp.status, resp.read().decode())
            finally:
                conn.close()

        return calls(post)

    return with_openai(Core(fleet), Tokenizer(), ask, runtime_lora=on, adapters=registry, **kw)


def fleet(config: dict[str, str] | None = None) -> Fleet:
    return Fleet({f"worker-{i}": Worker(config or {}) for i in range(2)})


def test_a_loaded_adapter_is_on_every_worker_and_in_the_registry(
    registry: AdapterRegistry,
) -> None:
    f = fleet()

    def calls(post: Any) -> list[Answer]:
        body = {"lora_name": "math", "lora_path": "/adapters/math"}
        return [
            post("/v1/load_lora_adapter", body),
            post("/v1/load_lora_adapter", body),  # the same again: done, nothing new
            post("/v1/load_lora_adapter", {"lora_name": "math", "lora_path": "/other"}),
        ]

    first, again, other = served(f, registry, calls)
    assert first.status_code == 200 and first.text == (
        "Success: LoRA adapter 'math' added successfully."
    )
    assert again.status_code == 200
    assert other.status_code == 400 and other.json()["error"]["param"] == "lora_name"
    assert all(w.adapters["math"] == ("/adapters/math", None) for w in f.workers.values())
    assert [m for m, _ in f.calls] == ["add_lora"]
    assert registry.all() == [RegisteredAdapter("math", "/adapters/math", None)]

    def unload(post: Any) -> list[Answer]:
        return [
            post("/v1/unload_lora_adapter", {"lora_name": "math"}),
            post("/v1/unload_lora_adapter", {"lora_name": "math"}),
        ]

    gone, missing = served(f, registry, unload)
    assert gone.status_code == 200 and "removed" in gone.text
    assert missing.status_code == 404
    assert registry.all() == [] and all("math" not in w.adapters for w in f.workers.values())


def test_a_refused_folder_is_undone_everywhere(registry: AdapterRegistry) -> None:
    f = fleet()
    f.workers["worker-1"].add_lora = lambda *a: (_ for _ in ()).throw(  # type: ignore[method-assign]
        ValueError("/adapters/x: rank 512 is over max_lora_rank 64")
    )
    (r,) = served(
        f,
        registry,
        lambda post: [
            post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/adapters/x"})
        ],
    )
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "lora_path"
    assert "worker-1" in err["message"] and "max_lora_rank" in err["message"]
    assert registry.all() == [] and all("x" not in w.adapters for w in f.workers.values())


def test_bad_bodies_name_their_field(registry: AdapterRegistry) -> None:
    def calls(post: Any) -> list[Answer]:
        return [
            post("/v1/load_lora_adapter", {"lora_path": "/a"}),
            post("/v1/load_lora_adapter", {"lora_name": "a/b", "lora_path": "/a"}),
            post("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "relative/a"}),
            post("/v1/load_lora_adapter", {"lora_name": "m", "lora_path": "/a"}),  # the base
            post("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": 3}),
            post("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/" + "a" * 5000}),
        ]

    answers = served(fleet(), registry, calls)
    assert [r.status_code for r in answers] == [400] * 6
    assert [r.json()["error"]["param"] for r in answers] == [
        "lora_name",
        "lora_name",
        "lora_path",
        "lora_name",
        "lora_path",
        "lora_path",
    ]
    assert registry.all() == []


def test_the_config_adapters_stay(registry: AdapterRegistry) -> None:
    f = fleet({"base-sql": "/adapters/sql"})

    def calls(post: Any) -> list[Answer]:
        return [
            post("/v1/unload_lora_adapter", {"lora_name": "base-sql"}),
            post("/v1/load_lora_adapter", {"lora_name": "base-sql", "lora_path": "/x"}),
        ]

    unload, load = served(f, registry, calls)
    assert unload.status_code == 400 and "cluster config" in unload.json()["error"]["message"]
    assert load.status_code == 400 and "taken" in load.json()["error"]["message"]
    assert all(w.adapters["base-sql"] == ("/adapters/sql", None) for w in f.workers.values())


def test_tenants_own_their_adapters(registry: AdapterRegistry) -> None:
    f = fleet()

    def calls(post: Any) -> list[Answer]:
        body = {"lora_name": "mine", "lora_path": "/adapters/mine"}
        return [
            post("/v1/load_lora_adapter", body, TOKENS["alice"]),
            post("/v1/load_lora_adapter", {**body, "lora_path": "/other"}, TOKENS["bob"]),
            post("/v1/unload_lora_adapter", {"lora_name": "mine"}, TOKENS["bob"]),
            post("/v1/unload_lora_adapter", {"lora_name": "mine"}),  # no token
        ]

    loaded, taken, bobs, anon = served(
        f, registry, calls, auth=TokenAuth(TOKENS), api_key=TOKENS["alice"]
    )
    assert loaded.status_code == 200
    assert taken.status_code == 400  # (a name is the cluster's: bob cannot shadow it)
    assert bobs.status_code == 404  # not his: as if it did not exist
    assert anon.status_code == 401
    assert all(w.adapters["mine"] == ("/adapters/mine", ("alice",)) for w in f.workers.values())
    assert registry.get("mine") == RegisteredAdapter("mine", "/adapters/mine", ("alice",))

    (gone,) = served(
        f,
        registry,
        lambda post: [post("/v1/unload_lora_adapter", {"lora_name": "mine"}, TOKENS["alice"])],
        auth=TokenAuth(TOKENS),
        api_key=TOKENS["alice"],
    )
    assert gone.status_code == 200 and registry.all() == []


def test_the_routes_are_off_unless_turned_on(registry: AdapterRegistry) -> None:
    f = fleet()
    (r,) = served(
        f,
        registry,
        lambda post: [post("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/a"})],
        on=False,
    )
    assert r.status_code == 404 and "router.runtime_lora" in r.json()["error"]["message"]
    assert f.calls == [] and registry.all() == []


def test_a_registry_that_does_not_answer_is_a_503(
    redis_server: Any, registry: AdapterRegistry
) -> None:
    f = fleet()
    redis_server.stop()
    (r,) = served(
        f,
        registry,
        lambda post: [post("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/a"})],
    )
    assert r.status_code == 503 and "adapter registry" in r.json()["error"]["message"]
    assert f.calls == []  # no worker loads what the registry does not keep

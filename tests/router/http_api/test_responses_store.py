"""Kept Responses API responses in a real redis-server: ``previous_response_id`` continues a
kept conversation (through any router: two servers share the store here), ``GET`` and
``DELETE /v1/responses/{id}``, ``store: false``, expiry, tenants that never see each
other's responses, and a Redis that does not answer."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import openai
import pytest

from kvstore.config import IndexConfig, make_client
from kvstore.requests.outputs import FinishReason
from router.http_api.response_store import MAX_RECORD_BYTES, ResponseStore
from router.serving.auth import TokenAuth
from tests.router.edges import with_openai
from tests.router.http_api.test_responses_api import Core, Tokenizer

pytestmark = pytest.mark.redis
TOKENS = {"alice": "tok-a", "bob": "tok-b"}


def store_of(redis_server: Any, ttl_s: float = 60.0, tenant_bytes: int = 1 << 20) -> ResponseStore:
    config = IndexConfig(url=redis_server.url, cluster="c", model_id="m", socket_timeout_s=2.0)
    return ResponseStore(make_client(config), config.namespace, ttl_s, tenant_bytes)


def serve(store: ResponseStore | None, ask: Any, *, api_key: str = "x", auth: Any = None) -> Any:
    core, tok = Core(["Hello", " world"], FinishReason.STOP, None), Tokenizer()
    return with_openai(core, tok, ask, api_key=api_key, auth=auth, responses_store=store), tok


def test_a_kept_response_is_continued_read_and_deleted(redis_server: Any) -> None:
    def ask(c: openai.OpenAI) -> Any:
        first = c.responses.create(model="m", input="hi", instructions="Be brief.")
        second = c.responses.create(
            model="m", input="more", previous_response_id=first.id, instructions="Be kind."
        )
        with c.responses.stream(model="m", input="again", previous_response_id=second.id) as s:
            third = s.get_final_response()
        fourth = c.responses.create(model="m", input="last", previous_response_id=third.id)
        got = c.responses.retrieve(first.id)
        c.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(first.id)
        return first, second, got, fourth

    (first, second, got, fourth), tok = serve(store_of(redis_server), ask)
    assert first.store is True and second.previous_response_id == first.id
    assert got.id == first.id and got.output_text == "Hello world"
    assert fourth.status == "completed"
    hi, ans = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello world"}
    # each turn sees the conversation before it; instructions are its own, not carried
    assert tok.chats[1] == [
        {"role": "system", "content": "Be kind."},
        hi,
        ans,
        {"role": "user", "content": "more"},
    ]
    assert tok.chats[3] == [
        hi,
        ans,
        {"role": "user", "content": "more"},
        ans,
        {"role": "user", "content": "again"},  # (kept before its stream's last event)
        ans,
        {"role": "user", "content": "last"},
    ]


def test_any_router_continues_a_response_another_kept(redis_server: Any) -> None:
    made = serve(store_of(redis_server), lambda c: c.responses.create(model="m", input="hi"))[0]
    _, tok = serve(
        store_of(redis_server),
        lambda c: c.responses.create(model="m", input="more", previous_response_id=made.id),
    )
    assert [m["content"] for m in tok.chats[0]] == ["hi", "Hello world", "more"]


def test_store_false_and_expired_responses_are_not_found(redis_server: Any) -> None:
    def ask(c: openai.OpenAI) -> Any:
        unkept = c.responses.create(model="m", input="hi", store=False)
        short = c.responses.create(model="m", input="hi")
        time.sleep(1.0)  # the store's records live 0.3 s here
        errors = []
        for rid in (unkept.id, short.id):
            with pytest.raises(openai.NotFoundError) as err:
                c.responses.create(model="m", input="x", previous_response_id=rid)
            errors.append(err.value.body)
        return unkept, errors

    (unkept, errors), _ = serve(store_of(redis_server, ttl_s=0.3), ask)
    assert unkept.store is False
    assert [e["param"] for e in errors] == ["previous_response_id"] * 2
    assert "no stored response" in errors[0]["message"]


def test_a_tenant_never_sees_another_tenants_responses(redis_server: Any) -> None:
    store = store_of(redis_server)
    auth = TokenAuth(TOKENS)
    made, _ = serve(
        store, lambda c: c.responses.create(model="m", input="hi"), api_key="tok-a", auth=auth
    )

    def as_bob(c: openai.OpenAI) -> list[int]:
        codes = []
        for call in (
            lambda: c.responses.retrieve(made.id),
            lambda: c.responses.delete(made.id),
            lambda: c.responses.create(model="m", input="x", previous_response_id=made.id),
        ):
            with pytest.raises(openai.NotFoundError) as err:
                call()
            codes.append(err.value.status_code)
        return codes

    codes, _ = serve(store_of(redis_server), as_bob, api_key="tok-b", auth=auth)
    assert codes == [404, 404, 404]
    got, _ = serve(
        store_of(redis_server), lambda c: c.responses.retrieve(made.id), api_key="tok-a", auth=auth
    )
    assert got.id == made.id  # still there for its own tenant


def test_a_redis_that_does_not_answer(redis_server: Any) -> None:
    store = store_of(redis_server)
    made, _ = serve(store, lambda c: c.responses.create(model="m", input="hi"))
    redis_server.stop()

    def ask(c: openai.OpenAI) -> Any:
        answered = c.responses.create(model="m", input="hi")  # answered, not kept (logged)
        with pytest.raises(openai.InternalServerError) as err:
            c.responses.create(model="m", input="x", previous_response_id=made.id)
        return answered, err.value

    (answered, err), _ = serve(store_of(redis_server), ask)
    assert answered.output_text == "Hello world"
    assert err.status_code == 503 and err.body["type"] == "service_unavailable"


def test_a_record_over_the_cap_is_answered_not_kept(redis_server: Any) -> None:
    store = store_of(redis_server)
    big = [{"role": "user", "content": "x" * MAX_RECORD_BYTES}]

    async def main() -> tuple[bool, bool, Any]:
        small = await store.put(None, {"id": "resp_small"}, big[:0])
        kept = await store.put(None, {"id": "resp_big"}, big)
        return small, kept, await store.get(None, "resp_big")

    assert asyncio.run(main()) == (True, False, None)


def test_a_tenant_over_its_budget_is_answered_without_keeping(redis_server: Any) -> None:
    """The budget counts the live records' bytes: one response fills this one; deleting it
    (or its expiry) makes room again; another tenant's budget is its own."""
    auth = TokenAuth(TOKENS)

    def ask(c: openai.OpenAI) -> list[bool]:
        first = c.responses.create(model="m", input="hi")
        second = c.responses.create(model="m", input="hi")
        with pytest.raises(openai.NotFoundError):  # not kept
            c.responses.retrieve(second.id)
        c.responses.delete(first.id)
        third = c.responses.create(model="m", input="hi")
        return [first.store, second.store, third.store]

    store = store_of(redis_server, tenant_bytes=1)
    kept, _ = serve(store, ask, api_key="tok-a", auth=auth)
    assert kept == [True, False, True]
    other, _ = serve(
        store, lambda c: c.responses.create(model="m", input="hi"), api_key="tok-b", auth=auth
    )
    assert other.store is True
    expiring = store_of(redis_server, ttl_s=0.3, tenant_bytes=1)

    def after_expiry(c: openai.OpenAI) -> list[bool]:
        c.responses.create(model="m", input="hi")
        full = c.responses.create(model="m", input="hi")
        time.sleep(1.0)
        return [full.store, c.responses.create(model="m", input="hi").store]

    assert serve(expiring, after_expiry)[0] == [False, True]


def test_ids_not_of_this_server_are_never_looked_up(redis_server: Any) -> None:
    store = store_of(redis_server)

    async def main() -> list[Any]:
        return [await store.get(None, rid) for rid in ("x", "resp_" + "0" * 32 + ":y", "")]

    assert asyncio.run(main()) == [None, None, None]

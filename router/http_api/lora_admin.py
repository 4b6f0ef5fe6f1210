"""vLLM's run-time LoRA routes, for the whole cluster: ``POST /v1/load_lora_adapter``
(``{"lora_name", "lora_path"}``) and ``POST /v1/unload_lora_adapter`` (``{"lora_name"}``),
served with ``router.runtime_lora`` (vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``).

A load is written to the cluster's adapter registry (Redis, ``kvstore/adapter_registry.py``)
before every worker is asked to load it, so a worker that restarts or joins later loads it at
start; a folder a worker refuses is unloaded everywhere again and answered 400 with the
worker's reason. The answer comes once this router routes to the adapter (the other routers
learn it from the workers' next heartbeat). With auth on, an adapter belongs to the tenant
that loaded it: listed and served to it alone, unloaded by it alone; another tenant gets the
404 of an adapter that does not exist. Adapters of the cluster config stay.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import redis
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from kvstore.adapter_registry import (
    ADAPTER_NAME,
    ADAPTER_NAME_RULE,
    AdapterRegistry,
    RegisteredAdapter,
)
from kvstore.requests.errors import InvalidRequest
from router.http_api.fields import get_str, shown
from router.placement.adapters import adapter_name
from router.placement.placement_types import NoWorkersError
from router.serving.request_errors import ModelNotFound, NoRoute, StoreUnavailable

if TYPE_CHECKING:
    from router.http_api.app import OpenAIServer

LOAD_TIMEOUT_S = 120.0  # a worker reading and checking an adapter's weights
VISIBLE_WAIT_S = 15.0  # until this router's view of the workers lists a loaded adapter
MAX_PATH_CHARS = 4096  # Linux's PATH_MAX


def _refusal(answers: dict[str, Any]) -> tuple[str, BaseException] | None:
    """The first worker that refused (raised a ValueError: an adapter it cannot load or
    unload), and its own error (unwrapped from Ray's); None: none refused."""
    for worker, answer in answers.items():
        cause = getattr(answer, "cause", None) or answer
        if isinstance(answer, BaseException) and isinstance(cause, ValueError):
            return worker, cause
    return None


class LoraAdmin:
    """The two routes of one HTTP server; ``registry``: the cluster's adapter registry (None:
    no Redis, adapters live as long as the workers that loaded them)."""

    def __init__(self, server: OpenAIServer, registry: AdapterRegistry | None, enabled: bool):
        self.s = server
        self.registry = registry
        self.enabled = enabled

    async def _body(self, request: Request) -> tuple[str | None, dict[str, Any], str]:
        if not self.enabled:
            raise NoRoute(
                f"no route {request.url.path}: run-time LoRA loading is off (router.runtime_lora)"
            )
        tenant = self.s.tenant(request)
        body = await self.s.json_body(request)
        if not isinstance(body, dict):
            raise InvalidRequest("body", type(body).__name__, "must be a JSON object")
        name = get_str(body, "lora_name")
        if not name or not ADAPTER_NAME.fullmatch(name):
            raise InvalidRequest("lora_name", shown(name), f"must be {ADAPTER_NAME_RULE}")
        if name == self.s.intake.model_id:
            raise InvalidRequest("lora_name", name, "is the base model's name")
        return tenant, body, name

    async def _registry(self, method: str, *args: Any) -> Any:
        """A registry call off the event loop; Redis not answering is a 503."""
        try:
            return await asyncio.to_thread(getattr(self.registry, method), *args)
        except redis.RedisError as exc:
            raise StoreUnavailable(f"the adapter registry (Redis) did not answer: {exc}") from exc

    async def _registered(self, name: str) -> RegisteredAdapter | None:
        return None if self.registry is None else await self._registry("get", name)

    async def load(self, request: Request) -> Response:
        try:
            tenant, body, name = await self._body(request)
            path = get_str(body, "lora_path")
            if not path or not path.startswith("/") or len(path) > MAX_PATH_CHARS:
                raise InvalidRequest(
                    "lora_path",
                    shown(path),
                    f"must be an absolute folder path of at most {MAX_PATH_CHARS} characters",
                )
            owners = (tenant,) if tenant is not None else None
            adapter = RegisteredAdapter(name, path, owners)
            known = await self._registered(name)
            if known == adapter:  # the same load again: done
                return _done(f"LoRA adapter '{name}' added successfully.")
            taken = InvalidRequest("lora_name", name, "is taken: an adapter has this name")
            if known is not None or name in await self._served():
                raise taken
            # registered first (a worker that starts now loads it too), and only once: of two
            # clients loading one name at once, the second is refused
            if self.registry is not None and not await self._registry("add", adapter):
                raise taken
            try:
                await self._load_everywhere(name, path, owners)
            except BaseException:
                await self._forget(name, strict=False)
                raise
            await self._until_visible(name, tenant)
            return _done(f"LoRA adapter '{name}' added successfully.")
        except Exception as exc:
            return self.s.error(exc)

    async def unload(self, request: Request) -> Response:
        try:
            tenant, _, name = await self._body(request)
            visible = name in await self.s.intake.adapters(tenant)
            if self.registry is None:  # (no registry: what the workers serve to the caller)
                mine = visible
            else:
                known = await self._registered(name)
                mine = known is not None and (known.tenants is None or tenant in known.tenants)
                if known is None and visible:
                    raise InvalidRequest(
                        "lora_name", name, "is an adapter of the cluster config; it stays"
                    )
            if not mine:
                raise ModelNotFound(f"LoRA adapter {name!r} does not exist")
            await self._forget(name)
            self.s.handlers.answers.forget()
            return _done(f"LoRA adapter '{name}' removed successfully.")
        except Exception as exc:
            return self.s.error(exc)

    async def _load_everywhere(self, name: str, path: str, owners: tuple[str, ...] | None) -> None:
        """The adapter loaded on every worker; a worker's refusal (a folder it cannot serve)
        is the client's error, naming the field; workers that did not answer load it at
        start."""
        tenants = list(owners) if owners else None
        answers = await self.s.core.directory.every_worker(
            "add_lora", name, path, tenants, timeout_s=LOAD_TIMEOUT_S
        )
        if not answers:
            raise NoWorkersError("no worker is running")
        if (refused := _refusal(answers)) is not None:
            worker, cause = refused
            raise InvalidRequest("lora_path", shown(path), f"was refused by {worker}: {cause}")

    async def _served(self) -> set[str]:
        """The adapters live workers serve, every tenant's."""
        loads = await self.s.core.directory.candidates()
        return {adapter_name(i) for ld in loads.values() for i in ld.lora_ids}

    async def _forget(self, name: str, strict: bool = True) -> None:
        """Unload ``name`` from the registry and every worker (a worker that does not answer
        has it until it restarts, when the registry no longer lists it); ``strict``: a
        worker's refusal is the client's error."""
        if self.registry is not None:
            await self._registry("remove", name)
        answers = await self.s.core.directory.every_worker(
            "remove_lora", name, timeout_s=LOAD_TIMEOUT_S
        )
        if strict and (refused := _refusal(answers)) is not None:  # (a config adapter's name)
            raise InvalidRequest("lora_name", name, str(refused[1]))

    async def _until_visible(self, name: str, tenant: str | None) -> None:
        deadline = time.monotonic() + VISIBLE_WAIT_S
        while name not in await self.s.intake.adapters(tenant):
            if time.monotonic() > deadline:
                break  # (loaded; this router learns it with the next heartbeat)
            await asyncio.sleep(0.05)
        self.s.handlers.answers.forget()  # /v1/models lists it from now on


def _done(message: str) -> Response:
    """vLLM's answer: plain text."""
    return PlainTextResponse(f"Success: {message}")

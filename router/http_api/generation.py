"""POST /v1/completions and /v1/chat/completions over the intake: one request's prompts
merged into one answer, whole or as server-sent events.

A client that goes away, before or during its stream, cancels the generation, and the
serving core aborts the request on its worker.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvstore.requests.outputs import GenerationResult, RequestOutput, Usage
from router.http_api.responses import Shaper
from router.http_api.responses_shaper import ResponsesShaper
from router.serving.edge_intake import Intake
from router.serving.generate_spec import GenerateSpec
from router.serving.request_errors import Mapped, classify

WORKER_HEADER = "x-kvcluster-worker"


def error_body(
    exc: BaseException, names: Any = None, intake: Intake | None = None
) -> tuple[int, dict[str, Any]]:
    """The answer's status and OpenAI error body (counted in the intake's metrics)."""
    err = _counted(exc, names, intake)
    return err.http_status, _body(err)


def error_response(
    exc: BaseException,
    names: Any = None,
    intake: Intake | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """The error as a whole answer: its body, status, and a ``Retry-After`` when retrying
    may succeed (full queues, no live worker), which the ``openai`` client waits for."""
    err = _counted(exc, names, intake)
    headers = dict(headers or {})
    if err.retry_after_s is not None:
        headers["retry-after"] = str(err.retry_after_s)
    return JSONResponse(_body(err), status_code=err.http_status, headers=headers)


def _counted(exc: BaseException, names: Any, intake: Intake | None) -> Mapped:
    err = classify(exc, names)
    if intake is not None:
        intake.metrics.failures.labels(str(err.http_status)).inc()
    return err


def _body(err: Mapped) -> dict[str, Any]:
    body = {"message": err.message, "type": err.kind, "param": err.param, "code": err.code}
    return {"error": body}


async def until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class _EventStream(StreamingResponse):
    """SSE that also watches for the client leaving while no event is due (a request still
    queued, a long prefill): Starlette's own response notices only when a send fails.
    ``gone``: the request's one disconnect watcher (from before the first output), ended
    with the stream."""

    def __init__(self, gone: asyncio.Future, content: Any, **kw: Any) -> None:
        super().__init__(content, **kw)
        self.gone = gone

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = asyncio.ensure_future(self.stream_response(send))
        try:
            await asyncio.wait({body, self.gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (body, self.gone):
                t.cancel()
            await asyncio.gather(body, self.gone, return_exceptions=True)


Item = tuple[int, str, RequestOutput]  # (prompt index, worker, output)


class Generation:
    """One request's answer, from its validated specs and their prompts' token ids; the
    shaper makes it its API's objects (chat and text completions, or a Responses API
    response): ``whole``, or a stream of ``opening``, an ``event`` per output,
    ``closing`` (or ``failed``); ``settle`` after the answer ended, before it is sent."""

    def __init__(
        self,
        intake: Intake,
        shaper: Shaper | ResponsesShaper,
        specs: Sequence[GenerateSpec],
        token_lists: Sequence[list[int]],
    ) -> None:
        self.intake = intake
        self.shaper = shaper
        self.specs = specs
        self.token_lists = token_lists

    async def _outputs(self) -> AsyncIterator[Item]:
        """Every prompt's outputs as they come; closing this (or an error in one prompt)
        cancels the others, and the core aborts each on its worker."""
        specs, lists = self.specs, self.token_lists
        if len(specs) == 1:
            async for worker, out in self.intake.generate(specs[0], lists[0]):
                yield 0, worker, out
            return
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(i: int) -> None:
            try:
                async for worker, out in self.intake.generate(specs[i], lists[i]):
                    queue.put_nowait((i, worker, out))
            except Exception as exc:
                queue.put_nowait((i, None, exc))
            finally:
                queue.put_nowait((i, None, done))

        tasks = [asyncio.create_task(pump(i)) for i in range(len(specs))]
        try:
            running = len(tasks)
            while running:
                i, worker, item = await queue.get()
                if item is done:
                    running -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, worker, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def answer(self, request: Request, headers: dict[str, str]) -> Response:
        names = self.specs[0].names
        outputs = self._outputs()
        # one watcher of the client for the whole answer: the wait for the first output,
        # then the stream (or the whole answer's collection)
        gone = asyncio.ensure_future(until_disconnect(request.receive))
        streaming = False
        try:
            # the first output before any header: it names the worker, and an error before
            # it (full queues, no worker) still gets its own status code
            try:
                first = await _unless(gone, anext(outputs))
            except StopAsyncIteration:
                first = None
            except Exception as exc:
                await outputs.aclose()
                return error_response(exc, names, self.intake, headers)
            if first is None:  # client gone (or nothing produced): nothing to answer
                await outputs.aclose()
                return Response(status_code=499)
            headers = {WORKER_HEADER: first[1], **headers}
            if self.shaper.stream:
                streaming = True  # the stream ends the watcher
                events = self._events(first, outputs)
                return _EventStream(gone, events, headers=headers, media_type="text/event-stream")
            try:
                result = await _unless(gone, self._collect(first, outputs))
            except Exception as exc:
                return error_response(exc, names, self.intake, headers)
            finally:
                await outputs.aclose()
        finally:
            if not streaming:
                gone.cancel()
                await asyncio.gather(gone, return_exceptions=True)
        if result is None:
            return Response(status_code=499)
        return JSONResponse(result, headers=headers)

    async def _collect(self, first: Item, rest: AsyncIterator[Item]) -> dict[str, Any]:
        results: dict[int, GenerationResult] = {}

        def add(item: Item) -> None:
            i, _, out = item
            results.setdefault(i, GenerationResult(out.request_id, [])).add(out)

        add(first)
        async for item in rest:
            add(item)
        completions = [(i, c) for i, r in sorted(results.items()) for c in r.completions]
        usages = [r.usage for _, r in sorted(results.items()) if r.usage is not None]
        prompts = {i: r.prompt_logprobs for i, r in results.items()}
        whole = self.shaper.whole(completions, usages, prompts)
        await self.shaper.settle()
        return whole

    async def _events(self, first: Item, rest: AsyncIterator[Item]) -> AsyncIterator[bytes]:
        shaper = self.shaper
        usages: dict[int, Usage] = {}
        prompts: dict[int, Any] = {}  # prompt index -> its prompt logprobs (first output)
        started: set[int] = set()

        def events(item: Item) -> bytes:
            """An output's events (one per changed sample), as one write (b"": none)."""
            i, _, out = item
            usages[i] = out.usage
            if out.prompt_logprobs is not None:
                prompts[i] = out.prompt_logprobs
            if len(out.outputs) == 1:  # (the common case: no list, no join)
                d = out.outputs[0]
                key = i * shaper.n + d.index
                first = key not in started
                if first:
                    started.add(key)
                return shaper.event(i, d, first, out.usage, prompts.get(i))
            out_events = []
            for d in out.outputs:
                key = i * shaper.n + d.index
                out_events.append(shaper.event(i, d, key not in started, out.usage, prompts.get(i)))
                started.add(key)
            return b"".join(out_events)

        try:
            if data := shaper.opening():
                yield data
            if data := events(first):
                yield data
            async for item in rest:
                if data := events(item):  # (an output may carry no changed sample)
                    yield data
            tail = shaper.closing(list(usages.values()))
            await shaper.settle()  # (a kept response: kept before its last event)
            yield tail
        except Exception as exc:  # headers are sent: the error goes in the stream
            yield shaper.failed(error_body(exc, self.specs[0].names, self.intake)[1])
        finally:
            await rest.aclose()  # aborts what is still running (client gone)


async def unless_gone(request: Request, awaitable: Any) -> Any:
    """``awaitable``'s result, or None when the client disconnects first (it is then
    cancelled, which aborts its requests)."""
    gone = asyncio.ensure_future(until_disconnect(request.receive))
    try:
        return await _unless(gone, awaitable)
    finally:
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)


async def _unless(gone: asyncio.Future, awaitable: Any) -> Any:
    """``awaitable``'s result, or None (it cancelled) once ``gone`` is done first."""
    work = asyncio.ensure_future(awaitable)
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work.done():
            work.cancel()
    if work.cancelled() or not work.done():
        await asyncio.gather(work, return_exceptions=True)
        return None
    return work.result()

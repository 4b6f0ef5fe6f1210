"""The chaos run's mixed load: seeded streams, unary calls, client cancels, disconnects,
tight deadlines and malformed requests spread over the routers, each with the gRPC codes it
may end with (on a healthy cluster, and while faults are injected)."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import grpc

from benchmarks.chaos_probes import NON_UTF8_TEXT, raw_generate
from cluster.client import KVClusterClient, build_request

SYSTEMS = [
    "You are a support agent for a train company. Be brief and quote timetables. ",
    "You review pull requests for a distributed cache written in Python; list bugs first. ",
    "You translate short English sentences to French and explain one word of grammar. ",
]
# request kinds and their share of the load
MIX = {
    "stream": 0.40,
    "unary": 0.12,
    "cancel": 0.13,
    "disconnect": 0.08,
    "deadline": 0.10,
    "bad": 0.17,
}
# the codes each kind may end with on a healthy cluster
EXPECTED = {
    "stream": {"OK"},
    "unary": {"OK"},
    "cancel": {"OK", "CANCELLED"},
    "disconnect": {"OK", "CANCELLED"},
    "deadline": {"OK", "DEADLINE_EXCEEDED"},
    "bad": {"INVALID_ARGUMENT"},
}
# extra codes a well-formed request may get while faults are injected: its worker died after
# streaming began (UNAVAILABLE), or every queue was full (RESOURCE_EXHAUSTED)
UNDER_FAULTS = {"UNAVAILABLE", "RESOURCE_EXHAUSTED"}


# -- the mixed load ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """How one request of the load ended."""

    index: int  # position in the load (also seeds it)
    kind: str  # one of MIX
    code: str  # gRPC status name; "OK" on success
    details: str  # status details ("" on success)
    seconds: float  # wall clock of the call
    ended: float  # time.monotonic() when it ended


@dataclass
class LoadResult:
    outcomes: list[Outcome] = field(default_factory=list)  # finished calls, in end order
    hung: int = 0  # calls still running past their deadline + grace (must be 0)

    def unexpected(self, faults: bool = False) -> list[Outcome]:
        """Outcomes whose code is not one their kind may end with."""
        extra = UNDER_FAULTS if faults else set()
        return [
            o
            for o in self.outcomes
            if o.code not in EXPECTED[o.kind] | (extra if o.kind != "bad" else set())
        ]


class MixedLoad:
    """Seeded requests of every kind in MIX, spread over the routers' endpoints."""

    def __init__(
        self,
        endpoints: list[str],
        *,
        seed: int = 0,
        max_tokens: int = 16,
        token: str | None = None,
        root_cert: bytes | None = None,
        deadline_s: float = 60.0,
    ) -> None:
        self.endpoints = list(endpoints)
        self.seed = seed
        self.max_tokens = max_tokens
        self.deadline_s = deadline_s
        self._auth = dict(token=token, root_cert=root_cert)
        self.clients = [KVClusterClient(e, **self._auth) for e in self.endpoints]
        self.done = 0  # calls finished so far (read by fault injectors)
        self._lock = threading.Lock()

    def close(self) -> None:
        for c in self.clients:
            c.close()

    def request(self, i: int) -> Outcome:
        rng = random.Random(self.seed * 1_000_003 + i)
        kind = rng.choices(list(MIX), weights=list(MIX.values()))[0]
        t0 = time.monotonic()
        try:
            code = getattr(self, f"_{kind}")(rng, i)
            details = ""
        except grpc.RpcError as exc:
            code, details = exc.code().name, exc.details() or ""
        with self._lock:
            self.done += 1
        end = time.monotonic()
        return Outcome(i, kind, code, details, end - t0, end)

    def run(self, n: int, *, concurrency: int = 8, start: int = 0) -> LoadResult:
        """Send requests ``start .. start+n-1``, ``concurrency`` at a time."""
        pool = ThreadPoolExecutor(concurrency, thread_name_prefix="load")
        pending = {pool.submit(self.request, i) for i in range(start, start + n)}
        finished: set = set()
        while pending:
            # every call has a gRPC deadline: a window that long without any call ending
            # means the calls still running are hung
            done, pending = wait(pending, timeout=self.deadline_s + 30)
            if not done:
                break
            finished |= done
        pool.shutdown(wait=False, cancel_futures=True)
        outcomes = [f.result() for f in finished]
        late = sum(o.seconds > self.deadline_s + 5 for o in outcomes)
        return LoadResult(outcomes, hung=len(pending) + late)

    # each kind: send, return the status name (or raise grpc.RpcError)

    def _prompt(self, rng: random.Random) -> str:
        words = " ".join(
            rng.choice(("cache", "route", "train", "block", "merge", "token"))
            for _ in range(rng.randint(2, 30))
        )
        return f"{rng.choice(SYSTEMS)}Question {rng.randrange(10**6)}: {words}?"

    def _client(self, i: int) -> KVClusterClient:
        return self.clients[i % len(self.clients)]

    def _params(self, rng: random.Random) -> dict:
        return dict(
            max_tokens=rng.randint(1, self.max_tokens),
            temperature=rng.choice((0.0, 0.8)),
            n=rng.choice((1, 1, 1, 2)),
            seed=rng.randrange(1000),
        )

    def _stream(self, rng: random.Random, i: int) -> str:
        self._client(i).generate(self._prompt(rng), timeout=self.deadline_s, **self._params(rng))
        return "OK"

    def _unary(self, rng: random.Random, i: int) -> str:
        self._client(i).unary(self._prompt(rng), timeout=self.deadline_s, **self._params(rng))
        return "OK"

    def _cancel(self, rng: random.Random, i: int) -> str:
        call = self._client(i).stream(
            build_request(self._prompt(rng), max_tokens=200, ignore_eos=True),
            timeout=self.deadline_s,
        )
        keep = rng.randint(0, 3)  # messages read before cancelling (0: at once)
        if keep:
            for got, _ in enumerate(call, start=1):
                if got >= keep:
                    break
            else:
                return "OK"  # ended before we cancelled
        call.cancel()
        return "CANCELLED"

    def _disconnect(self, rng: random.Random, i: int) -> str:
        client = KVClusterClient(self.endpoints[i % len(self.endpoints)], **self._auth)
        try:
            call = client.stream(
                build_request(self._prompt(rng), max_tokens=200, ignore_eos=True),
                timeout=self.deadline_s,
            )
            next(iter(call))
        finally:
            client.close()  # the connection goes away mid-stream
        return "CANCELLED"

    def _deadline(self, rng: random.Random, i: int) -> str:
        self._client(i).generate(
            self._prompt(rng), max_tokens=200, ignore_eos=True, timeout=rng.uniform(0.05, 0.4)
        )
        return "OK"

    def _bad(self, rng: random.Random, i: int) -> str:
        client = self._client(i)
        case = rng.choice(("token_ids", "text", "top_p", "max_tokens", "stop", "utf8"))
        if case == "utf8":
            raw_generate(
                client.channel, NON_UTF8_TEXT, metadata=client.metadata, timeout=self.deadline_s
            )
            return "OK"
        prompt = {"token_ids": [10**6], "text": ""}.get(case, self._prompt(rng))
        params = {
            "top_p": {"top_p": 1.5},
            "max_tokens": {"max_tokens": 10**6},
            "stop": {"stop": [""]},
        }.get(case, {})
        client.generate(prompt, timeout=self.deadline_s, **params)
        return "OK"

"""Grammar-constrained decoding: compile a request's constraint, mask its tokens, follow it.

A request with ``SamplingParams.structured`` gets its grammar compiled against the model's
tokenizer by :class:`GrammarCompiler`, on a thread of its own (llguidance releases the GIL
while it builds the lexer), cached by constraint: the engine thread never compiles. Until the
compile is done the request waits (``Request.awaiting_grammar``); the scheduler admits the
others past it. A compile that fails fails that request alone.

Each sequence of the request then carries its own matcher (``Sequence.matcher``), a copy of
the compiled template: forked samples copy their parent's, preempted sequences keep theirs
(their output tokens are kept, so the matcher stays in step with them whether their KV was
swapped or is recomputed), and only sampled tokens advance it. Per step,
:class:`~worker.engine.grammar_masks.GrammarMasks` fills the constrained rows' bitmasks in
one parallel call on a helper thread while the model runs, and ships them to the logits'
device, where the sampler masks them in one batched op.

A reasoning model (``<think>`` and ``</think>`` in its vocabulary, see
``worker/model/reasoning_markers.py``; ``EngineConfig.reasoning``) thinks first, then answers:
as vLLM does with a reasoning parser, the grammar constrains the answer alone. Where the
prompt leaves the output decides, once per request: inside an opened reasoning (DeepSeek-R1's
template), each sequence starts with its matcher held aside (``Sequence.held_matcher``) and
samples unconstrained; past a closed one (Qwen3 with ``enable_thinking: false``), the grammar
applies from the first token; before any (Qwen3's template), it applies from the first token,
which may also be ``<think>`` and then holds the matcher. The sampled ``</think>`` puts the
held matcher back, unadvanced: the grammar starts at the token after it.

Why llguidance rather than xgrammar (measured on SmolLM2's 49k-token byte-level BPE and
the tiny models' tokenizers, 8 JSON schemas, 2-core CPU): it imports without torch or
transformers (the router validates grammars and must not load torch; xgrammar's import pulls
both, 2.2 s), it reads our ``tokenizers`` JSON as is (xgrammar needs the vocabulary decoded
and its type detected), and it compiles a schema in 0.2-0.7 ms (xgrammar 0.6-4.7 ms). A
batch-32 mask costs 0.6 ms with llguidance and 0.1 ms with xgrammar, both under 1 % of a
batch-32 decode step of the 135M model here.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llguidance

from kvstore.requests.errors import InvalidRequest
from kvstore.requests.output_constraint import StructuredOutputs, parser_limits

if TYPE_CHECKING:
    from worker.engine.request import Request


@dataclass(frozen=True, slots=True)
class GrammarStats:
    """The compiler's figures since the engine started."""

    requests: int  # constraints asked for
    cache_hits: int  # of those, found compiled (or compiling) in the cache
    compiles: int  # compiles run (misses)
    compile_s: float  # seconds spent compiling, all compiles together
    failures: int  # compiles that failed (the request failed with the library's message)

    @property
    def hit_rate(self) -> float:
        return self.cache_hits / self.requests if self.requests else 0.0


class GrammarCompiler:
    """Compiles constraints against one tokenizer, off the engine thread, cached by constraint.

    Callers' obligations: ``submit`` is called from one thread at a time (the engine's, or
    under the engine loop's lock); the returned future's matcher is a template, never
    advanced: a request copies it (``deep_copy``) for each of its sequences."""

    def __init__(
        self,
        tokenizer_json: str,
        *,
        vocab_size: int,
        eos_ids: Sequence[int],
        cache_size: int = 256,
        threads: int = 1,
    ) -> None:
        self._tokenizer_json = tokenizer_json
        self._vocab_size = vocab_size
        self._eos_ids = list(eos_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None  # built on first compile
        self._tok_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[StructuredOutputs, Future[llguidance.LLMatcher]] = OrderedDict()
        self._cache_size = cache_size
        self._requests = self._hits = self._compiles = self._failures = 0
        self._compile_s = 0.0
        self.on_ready: Callable[[], None] | None = None  # called when any compile ends

    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the tokenizer (about 0.2 s to build for a 49k vocabulary)."""
        with self._tok_lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(
                    self._tokenizer_json, n_vocab=self._vocab_size, eos_token=self._eos_ids
                )
            return self._tokenizer

    def submit(self, spec: StructuredOutputs) -> Future[llguidance.LLMatcher]:
        self._requests += 1
        fut = self._cache.get(spec)
        if fut is not None:
            self._hits += 1
            self._cache.move_to_end(spec)
            return fut
        fut = self._pool.submit(self._compile, spec)
        fut.add_done_callback(self._ready)
        self._cache[spec] = fut
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return fut

    def _compile(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        tokenizer = self.tokenizer()  # (built once; not a compile's cost)
        start = time.perf_counter()
        try:
            grammar = spec.grammar()
            matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
            if matcher.is_error():
                raise InvalidRequest(
                    spec.field, spec.kind, f"does not compile: {matcher.get_error()}"
                )
            return matcher
        except Exception:
            self._failures += 1
            raise
        finally:
            self._compiles += 1
            self._compile_s += time.perf_counter() - start

    def _ready(self, _fut: Future) -> None:
        if self.on_ready is not None:
            self.on_ready()

    def wait_any(self, futures: Sequence[Future], timeout: float) -> None:
        """Block until one of ``futures`` is done (offline loops: no busy waiting)."""
        wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def stats(self) -> GrammarStats:
        return GrammarStats(
            self._requests, self._hits, self._compiles, self._compile_s, self._failures
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def compile_error(fut: Future) -> str:
    """Why a finished compile failed, as the request's error."""
    exc = fut.exception()
    assert exc is not None
    if isinstance(exc, InvalidRequest):
        return str(exc)
    return f"structured outputs: the grammar failed to compile: {type(exc).__name__}: {exc}"


def install_ready(compiling: list[Request]) -> tuple[list[Request], list[tuple[Request, str]]]:
    """Of the requests waiting for their grammar: those whose compile succeeded get a
    matcher per sequence (held while a reasoning their prompt opened lasts) and may be
    admitted; returns (still compiling, [(failed, why)])."""
    still, failed = [], []
    for req in compiling:
        fut = req.grammar
        assert fut is not None
        if req.finished:
            continue
        if not fut.done():
            still.append(req)
        elif fut.exception() is not None:
            failed.append((req, compile_error(fut)))
        else:
            template = fut.result()
            held = req.reasoning == "open"  # the prompt opened the reasoning: grammar after it
            for seq in req.seqs:
                if held:
                    seq.held_matcher = template.deep_copy()
                else:
                    seq.matcher = template.deep_copy()
            req.awaiting_grammar = False
    return still, failed

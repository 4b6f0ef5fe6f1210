"""Draft-free proposers for speculative decoding, chosen by name from a registry.

A proposer guesses the next tokens of a sequence from text it has seen (the sequence itself,
earlier prompts and responses); the engine verifies the guesses in one forward pass and keeps
the ones the model agrees with, so a proposer affects speed only, never the output.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from kvstore.runtime.registry import Registry


@dataclass(frozen=True, slots=True)
class CorpusKey:
    """Whose text a draft may come from: one tenant's (cache_salt) outputs under one adapter
    never draft another tenant's or another adapter's tokens."""

    tenant: str | None
    lora: str | None


class Proposer(ABC):
    """Proposes draft tokens. Caller's obligations: ``start`` a request before asking for
    its drafts, ``finish`` it exactly once (finished or aborted); ``propose`` is called with
    the sequence's whole token list (prompt and output so far), which only grows between
    calls for one request."""

    name: ClassVar[str]

    def __init__(self, min_n: int, max_n: int) -> None:
        assert 1 <= min_n <= max_n, (min_n, max_n)
        self.min_n = min_n  # shortest suffix that may match
        self.max_n = max_n  # longest suffix tried

    @abstractmethod
    def start(self, request_id: str, key: CorpusKey, prompt: Sequence[int] = ()) -> None:
        """A request begins (its drafts may come from ``key``'s corpus); ``prompt``: the
        start of every token list ``propose`` will see for it (indexed here, while the
        request waits for its prefill, rather than in its first decode step)."""

    @abstractmethod
    def propose(self, request_id: str, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that may follow ``tokens`` (empty: no guess)."""

    @abstractmethod
    def finish(self, request_id: str, tokens: Sequence[int] | None) -> None:
        """The request ended; ``tokens``: its prompt and output, to learn from (None: an
        aborted or failed request, learned from nothing)."""


PROPOSERS: Registry[type[Proposer]] = Registry("speculative method")
register_proposer = PROPOSERS.register


def create_proposer(name: str, min_n: int, max_n: int, **kwargs: int) -> Proposer:
    """The proposer registered as ``name`` (ValueError listing the valid names)."""
    return PROPOSERS.get(name)(min_n, max_n, **kwargs)

"""Suffix decoding drafts: continuations of the sequence's suffix, the most frequent next
token at each step, from an index over the request's own tokens and over the prompts and
responses of earlier requests of the same tenant and adapter (bounded, oldest forgotten)."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

from worker.engine.proposer import CorpusKey, Proposer, register_proposer

Gram = tuple[int, ...]


class NgramCounts:
    """For every n-gram (``min_n`` <= n <= ``max_n``) of the texts added, how often each
    token followed it. Texts can be removed again (counts go down, empty entries go)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.next: dict[Gram, dict[int, int]] = {}

    def add(self, tokens: Sequence[int], start: int = 0, sign: int = 1) -> None:
        """Count the n-grams followed by ``tokens[j]`` for every ``j >= start``."""
        for j in range(max(start, self.min_n), len(tokens)):
            tok = tokens[j]
            for n in range(self.min_n, min(self.max_n, j) + 1):
                gram = tuple(tokens[j - n : j])
                counts = self.next.get(gram)
                if counts is None:
                    counts = self.next[gram] = {}
                left = counts.get(tok, 0) + sign
                if left > 0:
                    counts[tok] = left
                else:
                    counts.pop(tok, None)
                    if not counts:
                        del self.next[gram]

    def best(self, context: Sequence[int]) -> tuple[int, int, float] | None:
        """(matched n, most frequent next token, its share) for the longest suffix of
        ``context`` seen, or None."""
        for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
            counts = self.next.get(tuple(context[len(context) - n :]))
            if counts:
                tok = max(counts, key=counts.__getitem__)
                return n, tok, counts[tok] / sum(counts.values())
        return None


class _Corpus:
    """One key's earlier texts, at most ``max_tokens`` tokens, oldest forgotten first."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.counts = NgramCounts(min_n, max_n)
        self.texts: deque[list[int]] = deque()
        self.num_tokens = 0


@register_proposer
class SuffixProposer(Proposer):
    """Suffix decoding over per-request and per-key corpora, bounded per worker:
    ``max_corpus_tokens`` tokens over all keys (the least recently used key's oldest text
    goes first). A draft extends token by token while the most frequent continuation of the
    longest matched suffix keeps a share of at least ``min_share_pct`` percent."""

    name = "suffix"

    def __init__(
        self,
        min_n: int,
        max_n: int,
        max_corpus_tokens: int = 200_000,
        max_text_tokens: int = 4096,
        min_share_pct: int = 30,
    ) -> None:
        super().__init__(min_n, max_n)
        self.max_corpus_tokens = max_corpus_tokens
        self.max_text_tokens = max_text_tokens  # a longer text is learned by its tail
        self.min_share = min_share_pct / 100
        self._corpora: OrderedDict[CorpusKey, _Corpus] = OrderedDict()  # LRU order
        self._total = 0
        self._own: dict[str, tuple[CorpusKey, NgramCounts, list[int]]] = {}  # by request id

    def start(self, request_id: str, key: CorpusKey, prompt: Sequence[int] = ()) -> None:
        own = NgramCounts(self.min_n, self.max_n)
        own.add(prompt)
        self._own[request_id] = (key, own, [len(prompt)])

    def propose(self, request_id: str, tokens: Sequence[int], k: int) -> list[int]:
        entry = self._own.get(request_id)
        if entry is None or k <= 0:
            return []
        key, own, seen = entry
        own.add(tokens, seen[0])  # the tokens it has not counted yet
        seen[0] = len(tokens)
        corpus = self._corpora.get(key)
        context = list(tokens[-self.max_n :])
        draft: list[int] = []
        while len(draft) < k:
            mine = own.best(context)
            theirs = corpus.counts.best(context) if corpus is not None else None
            pick = mine if theirs is None or (mine is not None and mine[0] >= theirs[0]) else theirs
            if pick is None or pick[2] < self.min_share:
                break
            draft.append(pick[1])
            context = context[1:] + [pick[1]] if len(context) >= self.max_n else context + [pick[1]]
        return draft

    def finish(self, request_id: str, tokens: Sequence[int] | None) -> None:
        entry = self._own.pop(request_id, None)
        if entry is None or tokens is None or len(tokens) <= self.min_n:
            return
        key = entry[0]
        text = list(tokens[-self.max_text_tokens :])
        corpus = self._corpora.get(key)
        if corpus is None:
            corpus = self._corpora[key] = _Corpus(self.min_n, self.max_n)
        self._corpora.move_to_end(key)
        corpus.counts.add(text)
        corpus.texts.append(text)
        corpus.num_tokens += len(text)
        self._total += len(text)
        while self._total > self.max_corpus_tokens:
            self._forget_oldest()

    def _forget_oldest(self) -> None:
        key, corpus = next(iter(self._corpora.items()))
        text = corpus.texts.popleft()
        corpus.counts.add(text, sign=-1)
        corpus.num_tokens -= len(text)
        self._total -= len(text)
        if not corpus.texts:
            del self._corpora[key]

    @property
    def corpus_tokens(self) -> int:
        """Tokens held over all keys (at most ``max_corpus_tokens``)."""
        return self._total

"""Prompt lookup (n-gram) drafts: the tokens that followed the latest earlier occurrence of
the sequence's last n tokens, longest n first (vLLM's ``ngram`` method)."""

from __future__ import annotations

from collections.abc import Sequence

from worker.engine.proposer import CorpusKey, Proposer, register_proposer


@register_proposer
class NgramProposer(Proposer):
    """Matches the sequence's suffix of ``max_n`` .. ``min_n`` tokens against the sequence
    itself (prompt and output); stateless across requests. A search scans the sequence
    backwards from its end (O(length) per try, in C), which stays below a step's cost for the
    context lengths a CPU worker serves."""

    name = "ngram"

    def start(self, request_id: str, key: CorpusKey, prompt: Sequence[int] = ()) -> None:
        pass

    def propose(self, request_id: str, tokens: Sequence[int], k: int) -> list[int]:
        length = len(tokens)
        if k <= 0:
            return []
        toks = list(tokens)
        rev = toks[::-1]  # candidates found by ``list.index`` (C) instead of a Python loop
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = toks[length - n :]
            first = suffix[0]
            # latest occurrence that ends before the suffix itself: toks[i] is rev[length-1-i]
            j = n  # i = length - n - 1
            while True:
                try:
                    j = rev.index(first, j)
                except ValueError:
                    break
                i = length - 1 - j
                if toks[i : i + n] == suffix:
                    return toks[i + n : i + n + k]
                j += 1
        return []

    def finish(self, request_id: str, tokens: Sequence[int] | None) -> None:
        pass

"""Draft-free proposers: n-gram prompt lookup and suffix decoding (tenant-scoped, bounded)."""

from __future__ import annotations

import random

import pytest

from worker.engine.ngram_proposer import NgramProposer
from worker.engine.proposer import PROPOSERS, CorpusKey, create_proposer
from worker.engine.suffix_proposer import SuffixProposer

A = CorpusKey("tenant-a", None)
B = CorpusKey("tenant-b", None)


def test_registry_names_both_and_rejects_unknown() -> None:
    assert {"ngram", "suffix"} <= set(PROPOSERS.names())
    assert isinstance(create_proposer("ngram", 1, 3), NgramProposer)
    with pytest.raises(ValueError, match="valid: ngram, suffix"):
        create_proposer("medusa", 1, 3)


def test_ngram_copies_what_followed_the_latest_match_longest_first() -> None:
    p = NgramProposer(1, 3)
    p.start("r", A)
    #        0  1  2  3  4  5  6  7  8  9
    toks = [1, 2, 3, 9, 9, 2, 3, 7, 8, 2, 3]
    # suffix [9? no] longest: (8,2,3)? absent; (2,3) latest earlier at 5 -> 7, 8, 2
    assert p.propose("r", toks, 3) == [7, 8, 2]
    assert p.propose("r", toks, 1) == [7]
    assert p.propose("r", [1, 2, 3, 4], 3) == []  # 4 never seen before
    assert NgramProposer(2, 3).propose("r", [5, 1, 5], 2) == []  # 1-gram matches only


def test_suffix_drafts_from_own_tokens_and_from_the_same_tenant_only() -> None:
    p = SuffixProposer(1, 4)
    p.start("r1", A)
    prompt = [10, 11, 12, 13, 14, 15]
    p.propose("r1", prompt, 4)
    p.finish("r1", prompt + [20, 21, 22, 23])
    p.start("r2", A)
    assert p.propose("r2", [5, 13, 14, 15, 20], 3) == [21, 22, 23]
    p.start("r3", B)  # another tenant never sees tenant A's response
    assert p.propose("r3", [5, 13, 14, 15, 20], 3) == []
    p.start("r4", CorpusKey("tenant-a", "adapter-1"))  # nor does another adapter
    assert p.propose("r4", [5, 13, 14, 15, 20], 3) == []
    # its own repeated text: [1,2,3] twice, then 1, 2 -> 3, 1, 2
    assert p.propose("r3", [1, 2, 3, 1, 2, 3, 1, 2], 3) == [3, 1, 2]


def test_suffix_corpus_is_bounded_oldest_text_forgotten() -> None:
    p = SuffixProposer(1, 3, max_corpus_tokens=10)
    for i, text in enumerate(([1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12])):
        p.start(f"r{i}", A)
        p.finish(f"r{i}", text)
    assert p.corpus_tokens == 6  # the first text went
    p.start("q", A)
    assert p.propose("q", [2, 3], 2) == []
    assert p.propose("q", [2, 3, 8, 9], 2) == [10, 11]
    p.finish("q", None)  # aborted: nothing learned
    assert p.corpus_tokens == 6


def _ngram_by_scan(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition, scanned backwards one position at a time."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        for i in range(length - n - 1, -1, -1):
            if tokens[i : i + n] == suffix:
                return tokens[i + n : i + n + k]
    return []


def test_ngram_search_matches_the_definition_on_random_sequences() -> None:
    rng = random.Random(7)
    p = NgramProposer(1, 4)
    for _ in range(500):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(0, 40))]
        k = rng.randrange(0, 5)
        want = _ngram_by_scan(tokens, k, 1, 4) if k else []
        assert p.propose("r", tokens, k) == want, (tokens, k)

"""Chained block keys: stable across processes, incremental == from scratch, salts isolate."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.blocks.hashing import HashContext, block_keys, hash_block, hash_full_blocks

CTX = HashContext("llama", "lora-1", "tenant")
PROMPT = list(range(40))
ROOT = Path(__file__).resolve().parents[2]

_CHILD = """
import json, sys
from kvstore.blocks.hashing import HashContext, block_keys
keys = block_keys(list(range(40)), 16, HashContext("llama", "lora-1", "tenant"))
print(json.dumps([k.hex() for k in keys] + [str(hash("salt"))]))
"""


def test_keys_are_stable_across_processes_and_hash_seeds() -> None:
    outputs = []
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", _CHILD],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        outputs.append(json.loads(out.stdout))
    assert outputs[0][-1] != outputs[1][-1]  # the seeds really differ for built-in hash()
    here = [k.hex() for k in block_keys(PROMPT, 16, CTX)]
    assert outputs[0][:-1] == here and outputs[1][:-1] == here


def test_golden_keys_pin_the_encoding() -> None:
    # The router and other machines compute these keys independently: the encoding must not
    # drift. If it must change, bump hashing._VERSION and update these values.
    assert block_keys(PROMPT, 16, CTX)[1].hex() == "ae80b70323e9f794253ca4197d68b2a1"
    assert block_keys([0, 1, 2**32 - 1, 7], 4)[0].hex() == "b14a3a092567e8dbc5ca9eb81e1f644a"


def test_incremental_chain_equals_from_scratch() -> None:
    tokens = list(range(100, 170))
    full = block_keys(tokens, 8, CTX)
    assert len(full) == 8  # trailing partial block gets no key
    head, toks = hash_full_blocks(tokens, 8, 0, 3, None, CTX)
    tail, _ = hash_full_blocks(tokens, 8, 3, 8, head[-1], CTX)
    assert head + tail == full and toks[1] == tuple(range(108, 116))
    assert block_keys(tokens, 8, CTX, start=3, parent=full[2]) == full[3:]


def test_different_context_changes_every_key() -> None:
    contexts = [
        HashContext(),
        HashContext("llama"),
        HashContext("llama", "lora-1"),
        HashContext("llama", None, "tenant"),
        HashContext("llama", None, "other-tenant"),
        HashContext("llama", None, ""),  # empty salt differs from no salt
        CTX,
    ]
    all_keys = [k for ctx in contexts for k in block_keys(PROMPT, 16, ctx)]
    assert len(set(all_keys)) == len(all_keys)


def test_parent_and_tokens_both_matter() -> None:
    a = hash_block(None, [1, 2])
    assert hash_block(None, [1, 2]) == a and len(a) == 16
    assert hash_block(a, [1, 2]) != a
    assert hash_block(None, [2, 1]) != a
    assert hash_block(None, [1, 2, 0]) != a
    with pytest.raises(ValueError, match="token ids"):
        hash_block(None, [-1])

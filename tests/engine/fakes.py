"""A fake *model* with a real paged KV cache, for fast exact scheduler tests.

Its "KV" is the token id (and position) stored in each slot. A step writes every chunk's
tokens into the slots its block table names, then reads each logits-wanting sequence's whole
context back *through its block table*; the logits are a deterministic pseudo-random function
of that context. So any scheduling bug — a wrong block table, a missing copy-on-write, a
prefix hit on blocks not written yet, a wrong position — changes the generated tokens, and
``reference_generate`` (which never touches a cache) gives the expected output.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch

from worker.engine.executor import ModelExecutor
from worker.engine.sched_output import ScheduledChunk

EOS = 1


def context_logits(context: Sequence[int], vocab: int) -> torch.Tensor:
    """Deterministic logits for a context (same function as the fake model)."""
    seed = zlib.crc32(torch.tensor(list(context), dtype=torch.int64).numpy().tobytes())
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, generator=g) * 3.0


class FakeExecutor(ModelExecutor):
    def __init__(
        self,
        num_blocks: int,
        block_size: int = 4,
        vocab_size: int = 64,
        max_model_len: int = 256,
        eos_token_ids: tuple[int, ...] = (EOS,),
        tokenizer=None,  # noqa: ANN001
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.tokenizer = tokenizer
        n = num_blocks * block_size
        self.slot_token = [-1] * n
        self.slot_pos = [-1] * n
        self.batches: list[list[tuple[int, int, bool]]] = []  # (start, num_tokens, logits)
        self.fail_next = False
        # logits from the last ``context_window`` tokens only (None: the whole context); a
        # short window makes greedy outputs repeat, so speculative drafts get accepted
        self.context_window: int | None = None

    def swap(self, transfers) -> None:  # noqa: ANN001 - no host tier (HostFakeExecutor has one)
        assert not transfers, "transfers without a host tier"

    def add_lora(self, name: str, path: str) -> str:
        raise AssertionError("the engine asks only executors with max_loras > 0")

    def remove_lora(self, name: str) -> None:
        raise AssertionError("the engine removes only adapters it registered")

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        bs = self.block_size
        snapshot = [
            (self.slot_token[s * bs : (s + 1) * bs], self.slot_pos[s * bs : (s + 1) * bs])
            for s, _ in pairs
        ]
        for (_, dst), (toks, pos) in zip(pairs, snapshot, strict=True):
            self.slot_token[dst * bs : (dst + 1) * bs] = toks
            self.slot_pos[dst * bs : (dst + 1) * bs] = pos

    def _slot(self, table: Sequence[int], pos: int) -> int:
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected model failure")
        self.batches.append([(c.start, c.num_tokens, c.wants_logits) for c in chunks])
        written: dict[int, int] = {}  # slot -> chunk that writes it in this step
        for i, c in enumerate(chunks):  # all writes first (like the attention backends)
            for j, tok in enumerate(c.token_ids):
                slot = self._slot(c.block_table, c.start + j)
                assert slot not in written, "two sequences write one slot in a step"
                written[slot] = i
                self.slot_token[slot], self.slot_pos[slot] = tok, c.start + j
        rows = []
        for i, c in enumerate(chunks):
            if not c.wants_logits:
                continue
            end = c.start + c.num_tokens
            first = c.start + 1 if c.drafts else end  # a verify: a row after every token
            ctx = []
            for pos in range(end):
                slot = self._slot(c.block_table, pos)
                # The backend contract: a cached prefix is never written in the same step.
                assert written.get(slot, i) == i, f"prefix slot {slot} is written in this step"
                assert self.slot_pos[slot] == pos, f"slot {slot} holds pos {self.slot_pos[slot]}"
                ctx.append(self.slot_token[slot])
            for e in range(first, end + 1):
                w = self.context_window
                rows.append(
                    context_logits(
                        ctx[:e] if w is None else ctx[max(0, e - w) : e], self.vocab_size
                    )
                )
        return torch.stack(rows) if rows else torch.empty(0, self.vocab_size)


def reference_generate(
    prompt: Sequence[int],
    max_tokens: int,
    vocab: int = 64,
    ignore_eos: bool = False,
    stop_ids: Sequence[int] = (EOS,),
    min_tokens: int = 0,
) -> list[int]:
    """Greedy generation straight from ``context_logits`` (no cache, no batching)."""
    ctx = list(prompt)
    out: list[int] = []
    while len(out) < max_tokens:
        logits = context_logits(ctx, vocab)
        if len(out) < min_tokens:
            logits[list(stop_ids)] = float("-inf")
        tok = int(logits.argmax())
        ctx.append(tok)
        out.append(tok)
        if tok in stop_ids and not ignore_eos:
            break
    return out

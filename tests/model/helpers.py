"""Small drivers that play the engine's role in the model tests."""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from worker.model.runner import ModelRunner, SeqChunk


class BlockHandout:
    """Hands out physical blocks in a shuffled order (so tables are never contiguous)."""

    def __init__(self, num_blocks: int, seed: int = 0) -> None:
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def table(self, num_tokens: int, block_size: int, table: list[int] | None = None) -> list[int]:
        table = list(table or [])
        while len(table) * block_size < num_tokens:
            table.append(self.free.pop())
        return table


def greedy_generate(
    runner: ModelRunner, prompts: Sequence[Sequence[int]], max_new: int, stop_ids=()
) -> list[list[int]]:
    """All prompts prefilled in one step, then decoded together; stops per sequence at an id in
    ``stop_ids`` (included in the output) or after ``max_new`` tokens."""
    blocks = BlockHandout(runner.num_blocks)
    bs = runner.block_size
    tables = [blocks.table(len(p) + max_new, bs) for p in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    chunks = [SeqChunk(list(p), 0, t) for p, t in zip(prompts, tables, strict=True)]
    active = list(range(len(prompts)))
    while active:
        logits = runner.execute(runner.build_input([chunks[i] for i in active]))
        next_ids = logits.argmax(-1).tolist()
        still = []
        for i, tok in zip(active, next_ids, strict=True):
            outputs[i].append(tok)
            pos = chunks[i].start_pos + len(chunks[i].token_ids)
            chunks[i] = SeqChunk([tok], pos, tables[i])
            if tok not in stop_ids and len(outputs[i]) < max_new:
                still.append(i)
        active = still
    return outputs


def hf_logits(model, ids: Sequence[int]) -> torch.Tensor:
    """float32 logits of every position of one sequence from a transformers model."""
    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits[0].float()


def interleaved_steps(runner: ModelRunner, seqs: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Two sequences in one batch per step through the paged cache: sequence 0 prefills in
    chunks of 5 while sequence 1 prefills 3 tokens, then decodes one per step; returns each
    sequence's logits rows, in order."""
    blocks = BlockHandout(runner.num_blocks, seed=3)
    tables = [blocks.table(len(s), runner.block_size) for s in seqs]
    got: list[list[torch.Tensor]] = [[], []]
    done = [0, 0]
    while done != [len(s) for s in seqs]:
        chunks: list[SeqChunk] = []
        owners: list[tuple[int, int]] = []
        for i, seq in enumerate(seqs):
            if done[i] == len(seq):
                continue
            step = 5 if i == 0 else (3 if done[1] == 0 else 1)
            new = seq[done[i] : done[i] + step]
            chunks.append(SeqChunk(new, done[i], tables[i], "all"))
            owners.append((i, len(new)))
            done[i] += len(new)
        logits = runner.execute(runner.build_input(chunks))
        row = 0
        for i, n in owners:
            got[i].append(logits[row : row + n])
            row += n
    return [torch.cat(g) for g in got]

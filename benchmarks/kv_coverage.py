"""How much of a hot prefix set the fleet holds, read from the cluster's block index.

For each system prompt of a workload, the chained keys of the blocks it fills; sampled in a
thread while a load runs, per prefix the leading blocks each worker holds (either tier):

- **coverage**: the hot set's blocks held somewhere in the fleet (per prefix, the longest
  leading run any one worker holds), as a share of the whole set — what a pull could reach;
- **copies**: blocks held, summed over workers, per hot-set block — the fleet's duplication.

A benchmark helper, not product code: it reads the index the routers read.
"""

from __future__ import annotations

import statistics
import threading
from collections.abc import Sequence

from kvstore.blocks.hashing import BlockKey, HashContext, block_keys


def prefix_keys(
    client, prefixes: Sequence[str], model_id: str, block_size: int
) -> list[list[BlockKey]]:  # noqa: ANN001
    """Per system prompt, the keys of the whole blocks every prompt of its group shares
    (two prompts of the group tokenized by the cluster, their common leading blocks)."""
    out = []
    for p in prefixes:
        a = client.tokenize(f"System: {p}\nUser: question 0 alpha")
        b = client.tokenize(f"System: {p}\nUser: question 1 beta")
        common = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))
        keys = list(block_keys(a, block_size, HashContext(model_id)))
        out.append(keys[: common // block_size])
    return out


class CoverageSampler:
    """Samples the index every ``period_s`` between :meth:`start` and :meth:`stop`."""

    def __init__(self, index, keys: list[list[BlockKey]], period_s: float = 0.25) -> None:  # noqa: ANN001
        self.index = index
        self.keys = [k for k in keys if k]
        self.period_s = period_s
        self._samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> tuple[float, float]:
        """(coverage, copies) now."""
        total = sum(len(k) for k in self.keys)
        held = copies = 0
        for keys in self.keys:
            counts = self.index.lookup_tiers(keys) or {}
            per = [min(sum(held.values()), len(keys)) for held in counts.values()]
            held += max(per, default=0)
            copies += sum(per)
        return held / total, copies / total

    def start(self) -> None:
        self._samples.clear()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._samples.append(self.sample())
            except Exception:  # noqa: BLE001 - a missed sample is no reason to fail a run
                pass
            self._stop.wait(self.period_s)

    def stop(self) -> tuple[float, float]:
        """Mean (coverage, copies) over the samples since :meth:`start`."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if not self._samples:
            return float("nan"), float("nan")
        return (
            statistics.fmean(c for c, _ in self._samples),
            statistics.fmean(d for _, d in self._samples),
        )

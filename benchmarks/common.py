"""Tiny helpers shared by the benchmarks: a text table, the final JSON line, the plot folder.

Kept small and stable on purpose — every benchmark and ``kvcluster bench`` report this way.
Imports nothing heavy: matplotlib is loaded only when a plot is made.

    run_all(fn, tasks, jobs)     # [fn(t) for t in tasks], on a process pool when jobs > 1
    print_table(rows, "title")   # rows: list of dicts with the same keys (the columns)
    emit_json({"name": value})   # the one JSON line of headline figures a benchmark ends with
    results_dir()                # where PNGs go ($KVCLUSTER_RESULTS_DIR or benchmarks/results/)
    plt = pyplot(); fig, ax = plt.subplots(); ...; save_figure(fig, "name.png")
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from multiprocessing import Pool
from pathlib import Path
from typing import Any, TextIO

RESULTS = Path(__file__).resolve().parent / "results"


def run_all(fn: Callable[[Any], Any], tasks: Sequence[Any], jobs: int) -> list[Any]:
    """``[fn(t) for t in tasks]``, in order; on ``jobs`` processes when ``jobs`` > 1 (``fn``
    and the tasks must pickle)."""
    if jobs <= 1:
        return [fn(t) for t in tasks]
    with Pool(jobs) as pool:
        return pool.map(fn, tasks, chunksize=1)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def print_table(rows: list[dict], title: str, out: TextIO | None = None) -> None:
    """Print ``rows`` as an aligned text table under ``title`` (columns = keys of rows[0])."""
    out = out or sys.stdout
    print(f"\n{title}", file=out)
    if not rows:
        print("  (no rows)", file=out)
        return
    cols = list(rows[0])
    cells = [[_fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  " + "  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True)), file=out)
    print("  " + "  ".join("-" * w for w in widths), file=out)
    for row in cells:
        print("  " + "  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)), file=out)


def emit_json(headline: dict, out: TextIO | None = None) -> None:
    """Print the benchmark's single JSON line of headline figures (name -> value)."""
    print(json.dumps(headline, sort_keys=False), file=out or sys.stdout, flush=True)


def results_dir() -> Path:
    """Folder for plots (created if missing): ``$KVCLUSTER_RESULTS_DIR``, else
    ``benchmarks/results/`` (where the committed figures live)."""
    env = os.environ.get("KVCLUSTER_RESULTS_DIR")
    path = Path(env) if env else RESULTS
    path.mkdir(parents=True, exist_ok=True)
    return path


def pyplot():  # noqa: ANN201 - matplotlib is an optional (dev) dependency
    """``matplotlib.pyplot`` on the non-interactive Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, name: str) -> Path:  # noqa: ANN001
    """Lay out, save as ``results_dir() / name`` (120 dpi), close; returns the path."""
    path = results_dir() / name
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    return path

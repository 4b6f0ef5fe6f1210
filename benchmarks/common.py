"""Tiny helpers shared by the benchmarks: a text table, the final JSON line, the plot folder.

Kept small and stable on purpose — other benchmarks import it:

    print_table(rows, "title")   # rows: list of dicts with the same keys (the columns)
    emit_json({"name": value})   # the one JSON line of headline figures a benchmark ends with
    results_dir()                # where PNGs go ($KVCLUSTER_RESULTS_DIR or benchmarks/results/)
    plt = pyplot(); fig, ax = plt.subplots(); ...; save_figure(fig, "name.png")
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def print_table(rows: list[dict], title: str) -> None:
    """Print ``rows`` as an aligned text table under ``title`` (columns = keys of rows[0])."""
    print(f"\n{title}")
    if not rows:
        print("  (no rows)")
        return
    cols = list(rows[0])
    cells = [[_fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  " + "  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True)))
    print("  " + "  ".join("-" * w for w in widths))
    for row in cells:
        print("  " + "  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))


def emit_json(headline: dict) -> None:
    """Print the benchmark's single JSON line of headline figures (name -> value)."""
    print(json.dumps(headline, sort_keys=False), flush=True)


def results_dir() -> Path:
    """Folder for plots (created if missing); ``$KVCLUSTER_RESULTS_DIR`` overrides it."""
    path = Path(os.environ.get("KVCLUSTER_RESULTS_DIR") or Path(__file__).parent / "results")
    path.mkdir(parents=True, exist_ok=True)
    return path


def pyplot():
    """``matplotlib.pyplot`` on the non-interactive Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, name: str) -> Path:
    """Lay out, save as ``results_dir() / name`` (120 dpi), close; returns the path."""
    path = results_dir() / name
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    return path

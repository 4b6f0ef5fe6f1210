"""Tiny helpers shared by the benchmarks: a text table, the final JSON line, the plot folder.

Kept small and stable on purpose — other benchmarks import it. The code lives in the
installed package (:mod:`cluster.report`) because ``kvcluster bench`` reports the same way:

    print_table(rows, "title")   # rows: list of dicts with the same keys (the columns)
    emit_json({"name": value})   # the one JSON line of headline figures a benchmark ends with
    results_dir()                # where PNGs go ($KVCLUSTER_RESULTS_DIR or benchmarks/results/)
    plt = pyplot(); fig, ax = plt.subplots(); ...; save_figure(fig, "name.png")
"""

from __future__ import annotations

from cluster.report import emit_json, print_table, pyplot, results_dir, save_figure

__all__ = ["emit_json", "print_table", "pyplot", "results_dir", "save_figure"]

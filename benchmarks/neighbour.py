"""The engine beside a CPU burner: how much a busy neighbour on one core costs.

Used by ``python -m benchmarks.engine_throughput --neighbour``. Each measurement runs the
engine in a fresh interpreter (OpenMP reads its wait policy when torch loads), on the same
model folder and prompts, once alone ("quiet") and once while another process spins on one
core ("busy"), under two settings:

* ``torch default``: OpenMP's default wait policy (threads spin at barriers);
* ``worker``: the environment a kvcluster worker runs with (:mod:`worker.cpu_threads`).

The figure of merit is quiet / busy throughput per setting (target: at most ~1.5x for the
worker setting). Rounds alternate settings and quiet/busy so that a load change on a shared
machine hits all cells alike; each cell reports the median of its rounds.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from worker.cpu_threads import WORKER_ENV, worker_env

_CHILD = """
import json, sys, time
if sys.argv[3] == "torch default":
    import torch  # loaded before the worker package: OpenMP keeps its default (spinning)
from worker.model.thread_count import configure_threads
threads = configure_threads(int(sys.argv[2]) or None)
from benchmarks.engine_throughput import run_engine
from kvstore.requests.sampling_params import SamplingParams
from worker.engine import Engine, EngineConfig
spec = json.loads(open(sys.argv[1]).read())
engine = Engine.from_model_dir(spec["model_dir"], EngineConfig(**spec["cfg"]))
engine.generate([spec["prompts"][0][:8]], SamplingParams(max_tokens=2))  # warm-up
n = spec["max_tokens"]
res = run_engine(engine, spec["prompts"], SamplingParams(temperature=0, max_tokens=n,
                                                         min_tokens=n))
from worker import cpu_threads
print("RESULT " + json.dumps({"tok_s": res["tok_s"], "wall": res["wall"], "threads": threads,
                              "policy": cpu_threads.effective_wait_policy}))
"""

BURNER = "while True:\n    pass\n"  # one core, no memory traffic to speak of


def _env(setting: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in WORKER_ENV}
    if setting == "worker":
        env.update(worker_env(env))
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _run_child(spec_file: Path, setting: str, threads: int) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(spec_file), str(threads), setting],
        capture_output=True,
        text=True,
        env=_env(setting),
        check=False,
        timeout=3600,
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"engine child failed (rc={proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(line[len("RESULT ") :])


def measure(spec: dict, spec_file: Path, *, rounds: int, threads: int) -> tuple[list, dict]:
    """Rows for the table and the headline figures."""
    spec_file.write_text(json.dumps(spec))
    settings = ("torch default", "worker")
    tok: dict[tuple[str, bool], list[float]] = {(s, b): [] for s in settings for b in (0, 1)}
    used_threads = 0
    for r in range(rounds):
        order = settings if r % 2 == 0 else settings[::-1]
        for busy in (False, True) if r % 2 == 0 else (True, False):
            burner = subprocess.Popen([sys.executable, "-c", BURNER]) if busy else None
            try:
                for setting in order:
                    res = _run_child(spec_file, setting, threads)
                    want = "PASSIVE" if setting == "worker" else None
                    if res["policy"] != want:
                        raise RuntimeError(f"{setting}: OpenMP wait policy {res['policy']}")
                    tok[(setting, busy)].append(res["tok_s"])
                    used_threads = res["threads"]
            finally:
                if burner is not None:
                    burner.kill()
                    burner.wait()
    rows, head = [], {}
    for setting in settings:
        quiet = statistics.median(tok[(setting, False)])
        busy = statistics.median(tok[(setting, True)])
        rows.append(
            {
                "setting": setting,
                "threads": used_threads,
                "quiet tok/s": quiet,
                "busy tok/s": busy,
                "quiet/busy": quiet / busy,
                "busy runs": " ".join(f"{x:.0f}" for x in tok[(setting, True)]),
            }
        )
        key = "worker" if setting == "worker" else "torch_default"
        head[f"neighbour_{key}_quiet_tok_s"] = round(quiet, 1)
        head[f"neighbour_{key}_busy_tok_s"] = round(busy, 1)
        head[f"neighbour_{key}_slowdown"] = round(quiet / busy, 3)
    head["neighbour_rounds"] = rounds
    head["neighbour_threads"] = used_threads
    return rows, head

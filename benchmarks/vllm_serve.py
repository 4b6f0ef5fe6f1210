"""``vllm serve`` from vLLM's own venv, for the served legs of the benchmarks: started on a
free loopback port with the engine limits the kvcluster side runs with, stopped at the end.

    with vllm_server(python, model_dir, max_num_seqs=256, max_model_len=384) as server:
        run_http(server.url, server.model, prompts, max_tokens)   # an OpenAI client's view

vLLM is not a dependency: its venv is ``--vllm-python`` / ``$VLLM_PYTHON``
(``benchmarks/vllm_bench.py``); without it the caller gets ``None`` and a note.
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from benchmarks.vllm_bench import vllm_command


@dataclass
class VllmServer:
    url: str  # http://127.0.0.1:PORT
    model: str  # the model name it answers to


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


@contextmanager
def vllm_server(
    python: str,
    model_dir: Path,
    *,
    max_num_seqs: int,
    max_model_len: int,
    max_num_batched_tokens: int = 2048,
    start_timeout_s: float = 600.0,
) -> Iterator[VllmServer | str]:
    """A running ``vllm serve`` of ``model_dir`` (float32, eager, no prefix caching), or a
    note (str) saying why there is none."""
    command = vllm_command(python)
    if command is None:
        yield f"skipped: no vLLM at {python} (--vllm-python or $VLLM_PYTHON)"
        return
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [
        *command,
        "serve",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--no-enable-prefix-caching",
        "--max-num-seqs",
        str(max_num_seqs),
        "--max-model-len",
        str(max_model_len),
        "--max-num-batched-tokens",
        str(max_num_batched_tokens),
    ]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", HF_HUB_OFFLINE="1")
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + start_timeout_s
            while not _healthy(url):
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    tail = log.read().strip().splitlines()[-1:]
                    yield f"failed to start (rc={proc.poll()}): {tail}"
                    return
                time.sleep(0.5)
            yield VllmServer(url, str(model_dir))
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)


def vllm_legs(
    python: str, model_dir: Path, prompts: list[list[int]], max_tokens: int, max_model_len: int
) -> tuple[dict | None, dict | None, list[str]]:
    """vLLM offline (``LLM.generate``) and served (``vllm serve`` + the SSE client of
    ``serving_path``) on the same prompts: each leg's figures (None when it did not run) and
    notes on what did not."""
    from benchmarks.engine_throughput import run_vllm  # (torch: only when vLLM runs)
    from benchmarks.stream_clients import run_http

    notes: list[str] = []
    offline = run_vllm(python, model_dir, prompts, max_tokens, 0)
    if isinstance(offline, str):
        return None, None, [f"vllm offline: {offline}"]
    served = None
    with vllm_server(
        python, model_dir, max_num_seqs=len(prompts), max_model_len=max_model_len
    ) as server:
        if isinstance(server, str):
            notes.append(f"vllm served: {server}")
        else:
            run = run_http(server.url, server.model, prompts, max_tokens)
            expected = len(prompts) * max_tokens
            assert run.tokens == expected, f"vllm http: {run.tokens} tokens, expected {expected}"
            served = {"tok_s": run.tok_s, "msgs/stream": run.messages / len(prompts)}
    return offline, served, notes

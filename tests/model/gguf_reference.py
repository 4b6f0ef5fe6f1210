"""``gguf.GGUFReader`` parses a real GGUF file once per test package, however many times the
reference code (transformers' GGUF loading, our reader's comparison) opens it.

GGUFReader builds a numpy view per vocabulary entry: a 262k-token file takes 10-20 s on CI's
two cores, and transformers parses it three times for one tokenizer and model (tokenizer
config, model config, weights). A reader is a read-only memory map of the file, so one parse
serves every reader of the same bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import gguf
import pytest

ParsedOnce = Callable[[Path], gguf.GGUFReader]


def reader_cache() -> tuple[ParsedOnce, Callable[[], None]]:
    """``(reader, clear)``: ``reader(path)`` is the one GGUFReader of that file (keyed by its
    resolved path, size and mtime: a rewritten file is parsed again)."""
    readers: dict[tuple[str, int, int], gguf.GGUFReader] = {}
    real = gguf.GGUFReader

    def reader(path: Path) -> gguf.GGUFReader:
        p = Path(path).resolve()
        st = p.stat()
        key = (str(p), st.st_size, st.st_mtime_ns)
        if key not in readers:
            readers[key] = real(p)
        return readers[key]

    return reader, readers.clear


@contextmanager
def transformers_parses_once(path: Path, reader: ParsedOnce) -> Iterator[None]:
    """Within: ``gguf.GGUFReader(path)`` (read-only, as transformers opens it) is ``reader(path)``;
    other files and modes get a reader of their own."""
    real = gguf.GGUFReader
    target = Path(path).resolve()

    def opened(p: object, mode: str = "r") -> gguf.GGUFReader:
        if mode == "r" and Path(p).resolve() == target:  # type: ignore[arg-type]
            return reader(target)
        return real(p, mode)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", opened)
        yield

"""Small C kernels for the CPU, compiled on first use and called through ctypes.

Why C through ctypes rather than a torch C++ extension: the kernels need no torch headers,
so the system C compiler builds them in well under a second (a ``torch.utils.cpp_extension``
build takes a minute of the two CI cores), and a ctypes call releases the GIL, so plain
Python threads run the work items in parallel.

The shared object is cached under ``$KVCLUSTER_CACHE`` (default ``~/.cache/kvcluster``) in
``kernels/``, named by a hash of the source, the compiler command and this CPU's feature flags
(``-march=native`` code must not move to another CPU). Several processes may build at once:
each compiles aside and renames into place. Without a C compiler ``load_kernels`` returns
``None`` with the reason in ``unavailable_reason()``; the ``cpu`` attention backend then
reports itself unavailable and ``auto`` falls back to ``torch``.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import logging
import os
import platform
import shutil
import subprocess
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import torch

from kvstore.runtime.cache_dir import cache_root

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
SOURCES = (SOURCE, SOURCE.with_name("argmax.c"))  # built into one shared object
# Not -ffast-math: a shared object linked with it sets flush-to-zero in the whole process at
# load time (crtfastmath), silently changing every float op of torch and Python. The few
# relaxations the reductions need to vectorise are asked for one by one instead.
CFLAGS = (
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fno-signed-zeros",
    "-fassociative-math",
    "-ffp-contract=fast",
    "-fPIC",
    "-shared",
    "-std=c11",
)
_reason: str | None = None
PIECES_PER_THREAD = 2  # work ranges per pool thread (finer balances better, each costs a call)
# logits elements from which argmax_rows splits its rows over the pool (below that, handing
# ranges to threads costs more than the pass: ~64 rows of a 8k vocabulary)
ARGMAX_SPLIT_ELEMENTS = 1 << 19


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build(compiler: str) -> Path:
    source = b"\0".join(path.read_bytes() for path in SOURCES)
    tag = hashlib.sha256(
        b"\0".join([source, compiler.encode(), " ".join(CFLAGS).encode(), _cpu_flags().encode()])
    ).hexdigest()[:16]
    target = cache_root() / "kernels" / f"paged_decode-{tag}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}")
    try:
        subprocess.run(
            [compiler, *CFLAGS, "-o", str(tmp), *map(str, SOURCES), "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


class NativeKernels:
    """The loaded library plus a thread pool that splits work items across CPU cores."""

    def __init__(self, lib: ctypes.CDLL, threads: int) -> None:
        fn = lib.kvc_paged_decode_f32
        i64, f32p = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [
            f32p,
            i64,
            i64,
            f32p,
            i64,
            i64,
            f32p,
            f32p,
            f32p,
            f32p,
            i64,
            f32p,
            i64,
            i64,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_float,
            ctypes.c_int,
        ]
        fn.restype = ctypes.c_int
        self._decode = fn
        argmax = lib.kvc_argmax_rows_f32
        argmax.argtypes = [f32p, i64, i64, i64, f32p]
        argmax.restype = None
        self._argmax = argmax
        self.threads = 1
        self._pool: ThreadPoolExecutor | None = None
        self.set_threads(threads)

    def set_threads(self, threads: int, fresh: bool = False) -> None:
        """Split work over ``threads`` pool threads (1: run it in the caller's thread);
        ``fresh``: a new pool even at the same size (its threads start from the next caller)."""
        threads = max(1, threads)
        if threads == self.threads and not fresh:
            return
        old, self.threads = self._pool, threads
        self._pool = ThreadPoolExecutor(threads, "kvc-attn") if threads > 1 else None
        if old is not None:
            old.shutdown(wait=False)  # a call in flight keeps the pool it submitted to

    def paged_decode(
        self,
        q: torch.Tensor,
        out: torch.Tensor,
        rows: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        spans: Sequence[tuple[int, int]],
        scale: float,
        window: int | None,
    ) -> None:
        """Attend decode ``i`` (q row ``rows[i]``) over its ``seq_lens[i]`` cached tokens and
        write ``out[rows[i]]``. q/out: ``[tokens, heads, head_dim]`` float32 with a contiguous
        last dim; caches contiguous; block_tables/seq_lens int32; rows int64; ``spans`` from
        ``split`` (a few per thread)."""
        heads, head_dim = q.shape[1], q.shape[2]
        kv_heads = k_cache.shape[2]
        assert q.dtype == out.dtype == k_cache.dtype == v_cache.dtype == torch.float32
        assert q.stride(2) == 1 and out.stride(2) == 1 and k_cache.is_contiguous()
        assert v_cache.is_contiguous() and block_tables.stride(1) == 1
        assert block_tables.dtype == seq_lens.dtype == torch.int32 and rows.dtype == torch.int64
        fixed = (
            q.data_ptr(),
            q.stride(0),
            q.stride(1),
            out.data_ptr(),
            out.stride(0),
            out.stride(1),
            rows.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            block_tables.data_ptr(),
            block_tables.stride(0),
            seq_lens.data_ptr(),
        )
        tail = (heads, kv_heads, head_dim, k_cache.shape[1], scale, window or 0)
        pool = self._pool  # once: set_threads may swap it meanwhile
        if pool is None or len(spans) == 1:
            results = [self._decode(*fixed, lo, hi, *tail) for lo, hi in spans]
        else:
            futures = [pool.submit(self._decode, *fixed, lo, hi, *tail) for lo, hi in spans]
            results = [f.result() for f in futures]
        if any(results):
            raise MemoryError("paged decode kernel could not allocate its score buffer")

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x.argmax(dim=-1)`` of a 2-D float32 CPU tensor with a contiguous last dim (the
        same answer: the first maximum, or the first NaN), in one vectorised pass per row."""
        assert x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu"
        assert x.stride(1) == 1 or x.shape[1] <= 1
        out = torch.empty(x.shape[0], dtype=torch.long)
        if x.shape[1] == 0:
            raise IndexError("argmax of an empty row")
        rows, n, stride = x.shape[0], x.shape[1], x.stride(0)
        pool = self._pool  # once: set_threads may swap it meanwhile
        if pool is None or rows * n < ARGMAX_SPLIT_ELEMENTS:
            self._argmax(x.data_ptr(), rows, n, stride, out.data_ptr())
            return out
        # rows are independent: a range per pool thread (ctypes lets go of the GIL), so a
        # greedy step of a large batch is not one core's pass over its whole logits
        base, dst, item = x.data_ptr(), out.data_ptr(), x.element_size()
        cuts = [rows * i // self.threads for i in range(self.threads + 1)]
        futures = [
            pool.submit(self._argmax, base + lo * stride * item, hi - lo, n, stride, dst + 8 * lo)
            for lo, hi in itertools.pairwise(cuts)
            if hi > lo
        ]
        for f in futures:
            f.result()
        return out

    def split(self, seq_lens: Sequence[int]) -> list[tuple[int, int]]:
        """Decodes ``0 .. n`` cut into ranges of similar context work, ``PIECES_PER_THREAD``
        per thread: the pool's threads take them in turn, so a thread that another process
        delays (a busy core) holds up one small piece, not a whole share of the step."""
        parts = self.threads * PIECES_PER_THREAD if self.threads > 1 else 1
        return split_items(seq_lens, parts)


def split_items(seq_lens: Sequence[int], parts: int) -> list[tuple[int, int]]:
    """Cut items ``0 .. n`` (item i costs ``seq_lens[i]``) into at most ``parts`` contiguous
    ranges of similar total cost."""
    total = sum(seq_lens)
    if parts == 1 or total == 0:
        return [(0, len(seq_lens))]
    spans, begin, done, share = [], 0, 0, total / parts
    for i, length in enumerate(seq_lens):
        goal = share * (len(spans) + 1)
        if len(spans) < parts - 1 and done + length >= goal:
            # cut at whichever side of item i lands nearer the goal
            cut = i if goal - done < done + length - goal and i > begin else i + 1
            spans.append((begin, cut))
            begin = cut
        done += length
    spans.append((begin, len(seq_lens)))
    return [s for s in spans if s[0] < s[1]]


@cache
def load_kernels() -> NativeKernels | None:
    """The compiled kernels, or ``None`` (reason in ``unavailable_reason()``)."""
    global _reason
    compiler = _compiler()
    if compiler is None:
        _reason = "no C compiler found (set CC, or install gcc)"
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        _reason = f"building {SOURCE.name} with {compiler} failed: {detail.strip()[:500]}"
        log.warning("native CPU kernels unavailable: %s", _reason)
        return None
    return NativeKernels(lib, torch.get_num_threads())


def resize_pool(threads: int, fresh: bool = False) -> None:
    """Give the loaded kernels a pool of ``threads``, a new one if ``fresh`` (nothing to do
    before they load: they take the loading thread's torch thread count, and their pool's
    threads start from the first thread that calls them)."""
    if load_kernels.cache_info().currsize:
        kernels = load_kernels()
        if kernels is not None:
            kernels.set_threads(threads, fresh)


def unavailable_reason() -> str | None:
    """Why ``load_kernels`` returned ``None``; ``None`` if they loaded (or were not tried)."""
    load_kernels()
    return _reason

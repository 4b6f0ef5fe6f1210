"""File operations of the disk KV store: verify a run file, read a slice of it, write one
durably, time a read of the directory, and name an I/O error for the log.

Plain functions over paths (no state): the store decides when each one runs, and on which
thread. Every check that fails raises :class:`~worker.kv.disk_format.CorruptRunFile`; a
write that fails raises the ``OSError`` for the store to turn itself off with.
"""

from __future__ import annotations

import errno
import logging
import os
import time

import numpy as np

from worker.kv.disk_format import (
    CorruptRunFile,
    RunFileHeader,
    block_checksum,
    decode_header,
    header_length,
    run_file_name,
)

log = logging.getLogger(__name__)

TMP_SUFFIX = ".tmp"  # files being written; any left at open are from an interrupted write
_PREFIX_BYTES = 12  # magic + header length: enough to size the header


def load_run_file(
    directory: str, name: str, fingerprint: str, block_bytes: int, *, verify: bool
) -> tuple[RunFileHeader, int, int]:
    """The header, size and payload bytes read (0 unless ``verify``) of the intact run file
    ``name``, written under ``fingerprint`` with blocks of ``block_bytes``; raises
    :class:`CorruptRunFile` otherwise (an unreadable file counts as corrupt). ``verify``
    checks every block's checksum too (reading the whole file)."""
    try:
        with open(os.path.join(directory, name), "rb") as fh:
            prefix = fh.read(_PREFIX_BYTES)
            header = decode_header(prefix + fh.read(header_length(prefix) - len(prefix)))
            if header.fingerprint != fingerprint:
                raise CorruptRunFile(f"foreign fingerprint {header.fingerprint!r}")
            if header.block_bytes != block_bytes:
                raise CorruptRunFile(f"block_bytes {header.block_bytes} (ours {block_bytes})")
            if run_file_name(header.keys) != name:
                raise CorruptRunFile("file name does not match its keys")
            size = os.fstat(fh.fileno()).st_size
            if size != header.file_bytes:
                raise CorruptRunFile(f"{size} bytes, expected {header.file_bytes} (torn write)")
            if not verify:
                return header, size, 0
            payload = memoryview(fh.read())
    except OSError as exc:
        raise CorruptRunFile(f"unreadable: {exc}") from None
    bb = block_bytes
    for i, (key, toks) in enumerate(zip(header.keys, header.token_ids, strict=True)):
        if (
            block_checksum(fingerprint, key, toks, payload[i * bb : (i + 1) * bb])
            != (header.checksums[i])
        ):
            raise CorruptRunFile(f"block {i}: checksum mismatch")
    return header, size, len(payload)


def pread_into(path: str, out: np.ndarray, header: RunFileHeader, first: int) -> None:
    """Read the payloads of blocks ``first ..`` of a run file into ``out`` (one read)."""
    offset = header.payload_offset + first * header.block_bytes
    want = out.nbytes
    fd = os.open(path, os.O_RDONLY)
    try:
        got = os.preadv(fd, [memoryview(out).cast("B")], offset)
    finally:
        os.close(fd)
    if got != want:
        raise CorruptRunFile(f"short read of {os.path.basename(path)}: {got} of {want} bytes")


def write_durably(tmp: str, final: str, directory: str, head: bytes, payload: bytes) -> None:
    """Write ``head + payload`` to ``tmp``, fsync it, rename it to ``final`` and fsync the
    directory: after a crash ``final`` is either absent or whole."""
    with open(tmp, "wb") as fh:
        fh.write(head)
        fh.write(payload)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, final)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a crash
    finally:
        os.close(fd)


def describe_write_error(path: str, exc: OSError) -> str:
    """One line for the log saying what went wrong with the directory."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"disk full writing to {path} ({exc.strerror})"
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"{path} is not writable ({exc.strerror})"
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        return f"{path} is gone ({exc.strerror})"
    return f"writing to {path} failed: {exc}"


def unlink_quietly(path: str) -> None:
    """Delete ``path`` if it is there; a failure is logged at debug level (the next open
    scans again)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.debug("disk KV tier: could not delete %s: %s", path, exc)


def probe_read_rate(directory: str, nbytes: int) -> float:
    """Bytes/s of a timed read of a freshly written file, dropped from the page cache first
    where the OS allows (so the figure is the disk's, not memory's). Raises OSError if the
    directory is not writable."""
    path = os.path.join(directory, "calibrate" + TMP_SUFFIX)
    data = os.urandom(nbytes)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, nbytes, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            got = len(os.pread(fd, nbytes, 0))
            elapsed = time.perf_counter() - t0
        finally:
            os.close(fd)
    finally:
        unlink_quietly(path)
    return got / max(elapsed, 1e-6)

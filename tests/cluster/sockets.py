"""Listening TCP sockets of a process tree, read from Linux ``/proc`` (no ``ss`` needed)."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Listener:
    pid: int  # process holding the socket
    command: str  # its /proc/<pid>/comm
    address: str  # bound IP address ("0.0.0.0", "::", "127.0.0.1", ...)
    port: int

    @property
    def loopback(self) -> bool:
        return ipaddress.ip_address(self.address).is_loopback


def _parse_hex_address(text: str) -> tuple[str, int]:
    host, port = text.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        ip = ipaddress.IPv4Address(raw[::-1])
    else:  # /proc/net/tcp6: four little-endian 32-bit words
        ip = ipaddress.IPv6Address(b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))
        if ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
    return str(ip), int(port, 16)


def _listening_inodes() -> dict[int, tuple[str, int]]:
    out: dict[int, tuple[str, int]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A":  # TCP_LISTEN
                out[int(fields[9])] = _parse_hex_address(fields[1])
    return out


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        kids.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    return kids


def descendants(root: int) -> set[int]:
    """``root`` and every process below it."""
    kids, out, todo = _children(), set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.add(pid)
            todo.extend(kids.get(pid, ()))
    return out


def process_group(pgid: int) -> set[int]:
    """Every process of process group ``pgid`` and their descendants."""
    members = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            members |= descendants(int(stat.parent.name))
    return members


def listeners(pids: set[int]) -> list[Listener]:
    """TCP sockets in LISTEN state held by ``pids``."""
    inodes = _listening_inodes()
    out = []
    for pid in sorted(pids):
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inode = int(target[8:-1])
                if inode in inodes:
                    out.append(Listener(pid, comm, *inodes[inode]))
    return sorted(set(out), key=lambda x: (x.pid, x.port))


def dashboard_processes(pids: set[int]) -> set[int]:
    """The pids among ``pids`` that run Ray's dashboard process (``dashboard/dashboard.py``,
    which Ray starts on a head even without the dashboard, with its usage-stats module)."""
    out = set()
    for pid in pids:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"dashboard/dashboard.py") for a in argv):
            out.add(pid)
    return out

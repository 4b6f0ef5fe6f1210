"""A throwaway sshd on a loopback port for `ray up` tests (never the system's sshd)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

SSHD = "/usr/sbin/sshd"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def missing_tools() -> list[str]:
    """What this harness needs and the machine lacks (`deploy/dev.sh install` provides them)."""
    need = {"sshd": SSHD, "ssh": "ssh", "ssh-keygen": "ssh-keygen", "rsync": "rsync"}
    return [name for name, exe in need.items() if shutil.which(exe) is None]


class LoopbackSSHD:
    """sshd on 127.0.0.1:<free port> with its own config, host key and one authorized
    throwaway key (``key``); ``proxy`` is an executable for ``ssh -o ProxyCommand=`` that
    reaches it (Ray's SSH runner has no port option)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.key = root / "id_ed25519"
        self.proxy = root / "proxy.sh"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 10.0) -> LoopbackSSHD:
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        host_key = self.root / "host_ed25519"
        for path in (self.key, host_key):
            subprocess.run(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True
            )
        authorized = self.root / "authorized_keys"
        authorized.write_text(self.key.with_suffix(".pub").read_text())
        authorized.chmod(0o600)
        config = self.root / "sshd_config"
        config.write_text(
            "\n".join(
                [
                    f"Port {self.port}",
                    "ListenAddress 127.0.0.1",
                    f"HostKey {host_key}",
                    f"PidFile {self.root / 'sshd.pid'}",
                    f"AuthorizedKeysFile {authorized}",
                    "PermitRootLogin yes",
                    "PubkeyAuthentication yes",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "UsePAM no",
                    "StrictModes no",
                    "MaxSessions 64",
                    "MaxStartups 64",
                    "",
                ]
            )
        )
        self.proxy.write_text(
            f"#!/bin/bash\nexec 3<>/dev/tcp/127.0.0.1/{self.port}\ncat <&3 &\ncat >&3\n"
        )
        self.proxy.chmod(0o700)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation dir
        log = open(self.root / "sshd.log", "ab")
        self.proc = subprocess.Popen(
            [SSHD, "-D", "-e", "-f", str(config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        while not listening(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"sshd did not start: {(self.root / 'sshd.log').read_text()}")
            time.sleep(0.1)
        return self

    def ssh(self, command: str, timeout_s: float = 30.0) -> subprocess.CompletedProcess:
        """Run ``command`` as Ray's SSH runner would (login shell) on this sshd."""
        return subprocess.run(
            [
                "ssh",
                "-i",
                str(self.key),
                "-o",
                "IdentitiesOnly=yes",
                "-o",
                "StrictHostKeyChecking=no",
                "-o",
                f"UserKnownHostsFile={os.devnull}",
                "-o",
                f"ProxyCommand={self.proxy}",
                "root@127.0.0.1",
                f"bash --login -c -i 'source ~/.bashrc; {command}'",
            ],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)  # the listener and its session children
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self.proc = None

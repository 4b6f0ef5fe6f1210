"""A real ``redis-server`` for tests: free loopback port, temp dir, no persistence.

``RedisServer`` can be stopped and started again on the same port (outage tests), and can
serve TLS (``tls=TlsFiles``) or require a password. No fakes: this is the real binary.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from cluster.local_redis import LocalRedis, TlsFiles, free_port

__all__ = ["RedisServer", "TlsFiles", "free_port", "make_tls_files"]


def make_tls_files(directory: Path) -> TlsFiles:
    """Generate a CA and a server cert valid for IP 127.0.0.1 with the ``openssl`` CLI."""
    d = Path(directory)
    ca, ca_key = d / "ca.pem", d / "ca.key"
    cert, key, csr = d / "server.pem", d / "server.key", d / "server.csr"
    ext = d / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")

    def ssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    ssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=kvc-test-ca",
        "-keyout",
        str(ca_key),
        "-out",
        str(ca),
    )
    ssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        str(key),
        "-out",
        str(csr),
    )
    ssl(
        "x509",
        "-req",
        "-in",
        str(csr),
        "-CA",
        str(ca),
        "-CAkey",
        str(ca_key),
        "-CAcreateserial",
        "-days",
        "1",
        "-extfile",
        str(ext),
        "-out",
        str(cert),
    )
    return TlsFiles(ca, cert, key)


RedisServer = LocalRedis
"""The launcher's own local Redis manager: one code path for the product and the tests."""

"""Generate Python gRPC code from the .proto files (run by the set-up command).

Generated modules land beside their .proto (``protos/kvcluster/v1/*_pb2*.py``), are ignored
by git and never edited by hand. Regeneration is skipped when they are newer than the .proto.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def stale(proto: Path) -> bool:
    outs = [proto.with_name(proto.stem + s) for s in ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")]
    return any(not o.exists() or o.stat().st_mtime < proto.stat().st_mtime for o in outs)


def build(force: bool = False) -> list[Path]:
    from grpc_tools import protoc  # dev dependency

    built = []
    for proto in sorted((ROOT / "protos").rglob("*.proto")):
        if not force and not stale(proto):
            continue
        rel = proto.relative_to(ROOT)
        args = [
            "protoc",
            f"-I{ROOT}",
            f"--python_out={ROOT}",
            f"--pyi_out={ROOT}",
            f"--grpc_python_out={ROOT}",
            str(rel),
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed for {rel}")
        built.append(rel)
    return built


if __name__ == "__main__":
    for p in build(force="--force" in sys.argv):
        print(f"[protos] generated code for {p}")

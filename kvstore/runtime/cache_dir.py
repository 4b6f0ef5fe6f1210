"""Where kvcluster keeps what it builds once per machine (native kernels, tiny test models,
rebuilt GGUF tokenizers): ``$KVCLUSTER_CACHE``, else ``$XDG_CACHE_HOME/kvcluster``, else
``~/.cache/kvcluster``."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    if os.environ.get("KVCLUSTER_CACHE"):
        return Path(os.environ["KVCLUSTER_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvcluster"

"""The model served when the config names none (``model.path: null``).

Each process that loads it (every worker, every router) calls :func:`resolve_default_model`
on its own node: a path resolved on the head means nothing on another machine. Its id is
known without resolving it (:func:`default_model_id`), so the head can fold it into block
keys and index keys before any worker has started.

Today the default is the offline tiny random model of ``family``; swapping it for another
default means changing these two functions together (the id must name what is resolved).
"""

from __future__ import annotations

from pathlib import Path

from worker.model.build_tiny import build_tiny_model, default_dir


def default_model_id(family: str = "llama") -> str:
    """The id of the default model (the name of the folder it resolves to), without building
    or downloading anything."""
    return default_dir(family, "tiny", 0).name


def resolve_default_model(family: str = "llama") -> Path:
    """This node's copy of the default model (built or found in ``$KVCLUSTER_CACHE``)."""
    path = build_tiny_model(family=family)
    if path.name != default_model_id(family):  # the id and the files must agree
        raise RuntimeError(f"default model resolved to {path}, not {default_model_id(family)}")
    return path

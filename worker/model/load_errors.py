"""Typed errors raised while loading a model folder. Each message names the file, the
value that was wrong and, where there is one, the fix."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model folder cannot be loaded (missing file, bad config, bad weights)."""


class UnsupportedModelError(ModelLoadError):
    """The folder is a valid Hugging Face folder, but of an architecture or option that this
    runner does not implement."""


class WeightMismatchError(ModelLoadError):
    """A checkpoint tensor is missing, unexpected, or has the wrong shape."""

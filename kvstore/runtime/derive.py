"""Records derived from another by field name: one function instead of a field-by-field copy,
so a field added to both records is carried without another line."""

from __future__ import annotations

from dataclasses import MISSING, fields
from typing import Any, TypeVar

T = TypeVar("T")


def derived(cls: type[T], *sources: object, **given: Any) -> T:
    """An instance of the dataclass ``cls``: each field is ``given``, else the same-named
    attribute of the first of ``sources`` that has one, else its default. A field without a
    default that neither gives is a ``TypeError`` naming it."""
    values = dict(given)
    for f in fields(cls):  # type: ignore[arg-type]
        if f.name in values or not f.init:
            continue
        for source in sources:
            if hasattr(source, f.name):
                values[f.name] = getattr(source, f.name)
                break
        else:
            if f.default is MISSING and f.default_factory is MISSING:
                raise TypeError(f"{cls.__name__}.{f.name}: no source has it and none was given")
    return cls(**values)

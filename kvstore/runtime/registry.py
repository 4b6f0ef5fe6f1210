"""Named implementations of one kind (routing policies, scheduling policies, attention
backends): one behaviour for all of them."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Classes registered under their ``name`` attribute. Registering a name twice raises
    ``ValueError``; looking up an unknown name raises ``error`` listing the valid ones."""

    def __init__(self, kind: str, error: type[Exception] = ValueError) -> None:
        self.kind = kind  # what the names name, for messages: "routing policy"
        self.error = error
        self._items: dict[str, T] = {}

    def register(self, cls: T) -> T:
        """Class decorator: make ``cls`` available under ``cls.name``."""
        name = cls.name  # type: ignore[attr-defined]
        if name in self._items:
            raise ValueError(f"{self.kind} {name!r} registered twice")
        self._items[name] = cls
        return cls

    def get(self, name: str, *, also_valid: Iterable[str] = ()) -> T:
        """The class named ``name``; ``also_valid``: names the caller resolves itself (listed
        in the error, e.g. "auto")."""
        try:
            return self._items[name]
        except KeyError:
            valid = ", ".join([*also_valid, *self.names()])
            raise self.error(f"unknown {self.kind} {name!r}; valid: {valid}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def names(self) -> list[str]:
        return sorted(self._items)

    def items(self) -> list[tuple[str, T]]:
        return sorted(self._items.items())

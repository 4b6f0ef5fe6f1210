"""How the worker<->router types cross process boundaries (Ray pickles them).

A frozen slots dataclass pickles its fields by position by default, so a router and a worker
one added field apart (a rolling upgrade) would read every later value into the wrong field.
Two forms instead:

* :class:`ByName` (per-request messages: ``SamplingParams``, ``WorkerRequest``, ``Admitted``,
  ...): the fields that differ from their defaults, by name. A field the sender does not know
  takes its default here; a field this side does not know is refused with
  :class:`WireMismatch` unless the sender left it at its default (then it was not sent).
  The receiver builds the object through its constructor, so its own validation runs.
* The per-step outputs stay positional tuples (``pack_output``: the hot path); their layout
  is named by :func:`schema_fingerprint`, which a router sends once when it opens a channel
  and the worker checks (``OUTPUT_SCHEMA``), never per item.
"""

from __future__ import annotations

import hashlib
from dataclasses import MISSING, Field, fields, is_dataclass
from enum import Enum
from typing import Any

from kvstore.requests.errors import WireMismatch

_NO_DEFAULT = object()
# per class: (field name, its default or _NO_DEFAULT) of its constructor's fields
_SPECS: dict[type, tuple[tuple[str, Any], ...]] = {}


def _spec(cls: type) -> tuple[tuple[str, Any], ...]:
    spec = _SPECS.get(cls)
    if spec is None:
        spec = _SPECS[cls] = tuple((f.name, _default(f)) for f in fields(cls) if f.init)
    return spec


def _default(f: Field) -> Any:
    """A field's default (a factory's value, compared by equality), or ``_NO_DEFAULT``."""
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return _NO_DEFAULT


class ByName:
    """Mixin of a dataclass that pickles its fields by name (see the module's docstring)."""

    __slots__ = ()

    def __reduce__(self) -> tuple:
        state = {}
        for name, default in _spec(type(self)):
            value = getattr(self, name)
            if value is default or (type(value) is type(default) and value == default):
                continue  # the receiver's default; not sent, so a newer field is harmless
            state[name] = value
        return _rebuild, (type(self), state)


def _rebuild(cls: type, state: dict[str, Any]) -> Any:
    """The object a peer sent, built here by name; see :class:`ByName`."""
    spec = _spec(cls)
    known = {name for name, _ in spec}
    unknown = sorted(set(state) - known)
    if unknown:
        shown = ", ".join(f"{n}={state[n]!r:.80}" for n in unknown)
        raise WireMismatch(
            f"{cls.__name__} from a peer sets field(s) this version does not know: {shown}"
        )
    missing = [name for name, default in spec if default is _NO_DEFAULT and name not in state]
    if missing:
        raise WireMismatch(
            f"{cls.__name__} from a peer lacks required field(s) {', '.join(missing)}"
        )
    return cls(**state)


def schema_fingerprint(*types: type) -> str:
    """A short digest of the field names (dataclasses) or member values (enums) of
    ``types``, in order: equal on two peers iff their positional layouts agree."""
    parts = []
    for t in types:
        if is_dataclass(t):
            names = [f.name for f in fields(t)]
        else:
            assert issubclass(t, Enum), t
            names = [str(m.value) for m in t]
        parts.append(f"{t.__module__}.{t.__qualname__}({','.join(names)})")
    return hashlib.blake2b(";".join(parts).encode(), digest_size=8).hexdigest()


def check_schema(what: str, theirs: str | None, ours: str) -> None:
    """Refuse a peer whose positional layout (``theirs``) is not this side's (``ours``)."""
    if theirs != ours:
        sent = "sent none (an older version)" if theirs is None else f"has {theirs}"
        raise WireMismatch(f"{what}: the peer {sent}, this side has {ours}")

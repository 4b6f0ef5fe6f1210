"""The index circuit breaker, on a fake clock: open on failure, skip, one probe per interval,
close on the first successful probe; and the prefix source routing by load meanwhile."""

from __future__ import annotations

import pytest

from kvstore.index_types import IndexUnavailable
from router.placement.breaker import CircuitBreaker, CircuitOpen
from router.placement.prefix_source import KVIndexSource, PrefixSourceUnavailable


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FlakyIndex:
    """A KVIndex stand-in for the breaker's bookkeeping: counts calls, fails while down."""

    def __init__(self) -> None:
        self.down = False
        self.calls = 0

    def lookup(self, keys):  # noqa: ANN001, ANN201
        self.calls += 1
        if self.down:
            raise IndexUnavailable("Redis timed out")
        return {"w0": len(keys)}


def test_breaker_opens_skips_probes_once_per_interval_and_closes() -> None:
    clock = Clock()
    b = CircuitBreaker(1.0, clock=clock)
    index = FlakyIndex()
    assert b.call(lambda: index.lookup([1])) == {"w0": 1}
    index.down = True
    with pytest.raises(IndexUnavailable):
        b.call(lambda: index.lookup([1]))
    assert b.is_open and b.opened == 1 and index.calls == 2
    for _ in range(50):  # within the interval: not one call reaches the index
        with pytest.raises(CircuitOpen):
            b.call(lambda: index.lookup([1]))
    assert index.calls == 2 and b.skipped == 50
    clock.now = 1.0  # a probe; it fails: open for another full interval
    with pytest.raises(IndexUnavailable):
        b.call(lambda: index.lookup([1]))
    assert index.calls == 3 and b.failures == 2 and b.opened == 1
    clock.now = 1.5
    with pytest.raises(CircuitOpen):
        b.call(lambda: index.lookup([1]))
    index.down = False
    clock.now = 2.0  # the next probe succeeds: closed, every call goes through again
    assert b.call(lambda: index.lookup([1, 2])) == {"w0": 2}
    assert not b.is_open
    assert b.call(lambda: index.lookup([1])) == {"w0": 1} and index.calls == 5


def test_one_probe_at_a_time_and_foreign_errors_leave_the_state() -> None:
    clock = Clock()
    b = CircuitBreaker(1.0, clock=clock)
    with pytest.raises(IndexUnavailable):
        b.call(lambda: (_ for _ in ()).throw(IndexUnavailable("down")))
    clock.now = 5.0

    def nested_probe() -> int:
        with pytest.raises(CircuitOpen):  # another read while the probe is in flight
            b.call(lambda: 0)
        raise KeyError("not an index failure")

    with pytest.raises(KeyError):
        b.call(nested_probe, failures=(IndexUnavailable,))
    assert b.is_open  # no verdict from a foreign error; the next read may probe
    assert b.call(lambda: 7) == 7 and not b.is_open


def test_prefix_source_fails_fast_while_open() -> None:
    clock = Clock()
    index = FlakyIndex()
    source = KVIndexSource(index, breaker=CircuitBreaker(1.0, clock=clock))  # type: ignore[arg-type]
    index.down = True
    with pytest.raises(PrefixSourceUnavailable):
        source.lookup([1])
    with pytest.raises(CircuitOpen):
        source.lookup([1])
    assert index.calls == 1


def test_probe_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="probe_interval_s"):
        CircuitBreaker(0)

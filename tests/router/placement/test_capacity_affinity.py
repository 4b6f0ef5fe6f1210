"""prefix_affinity's KV capacity check: a prefix goes only where it fits next to the prefixes
homed there (when it fits somewhere); a holder overfull with other prefixes spills it, and its
home moves, so the holder keeps the rest (router/placement/prefix_homes.py)."""

from __future__ import annotations

from router import Reason, RoutingConfig
from router.placement.prefix_homes import PrefixHomes
from tests.router.harness import MiniCluster, tokens
from worker.kv import block_keys

BS = 16
CAP = 10  # KV blocks per worker: two 4-block system prompts fit, three do not


def ask(
    cluster: MiniCluster, system: int, i: int, queues: tuple[int, int] = (0, 40)
) -> tuple[str, Reason]:
    """A request: system prompt ``system`` (4 blocks) + its own 16-token question, with the
    workers' queued prefill set to ``queues`` first (w1 busier: load alone picks w0)."""
    cluster.queue = dict(zip(("w0", "w1"), queues, strict=True))
    d = cluster.place(f"s{system}-{i}", tokens(system, 64) + tokens(1000 + 97 * system + i, 16))
    return d.worker_id, d.reason


def cluster(capacity_aware: bool = True) -> MiniCluster:
    cfg = RoutingConfig(
        policy="prefix_affinity",
        prefix_affinity={"capacity_aware": capacity_aware, "home_ttl_s": 10.0},
    )
    return MiniCluster(2, cfg, num_blocks=64, reported_blocks=CAP)


def test_first_placements_spread_by_kv_capacity() -> None:
    c = cluster()
    assert ask(c, 1, 0) == ("w0", Reason.NO_INDEX)  # the index is empty yet
    assert ask(c, 2, 0) == ("w0", Reason.LOAD)  # 4 + 4 <= 10
    assert ask(c, 3, 0) == ("w1", Reason.SPILL)  # 8 + 4 > 10 on w0
    assert ask(c, 1, 1) == ("w0", Reason.PREFIX)  # its own prefix counts once
    assert c.router.homes is not None
    assert dict(c.router.homes.committed(c.now)) == {"w0": 8, "w1": 4}


def test_without_the_check_one_worker_collects_every_prefix() -> None:
    c = cluster(capacity_aware=False)
    placed = []
    for system in (1, 2, 3):
        placed.append(ask(c, system, 0)[0])
    assert placed == ["w0", "w0", "w0"] and c.router.homes is None


def test_an_overfull_holder_spills_a_prefix_and_keeps_the_rest() -> None:
    c = cluster()
    assert [ask(c, s, 0)[0] for s in (1, 2)] == ["w0", "w0"]
    assert [ask(c, s, 0, queues=(40, 0))[0] for s in (3, 4)] == ["w1", "w1"]
    c.now = 5.0
    assert ask(c, 5, 0) == ("w0", Reason.LOAD)  # fits nowhere: placed by cost alone
    assert ask(c, 1, 1) == ("w0", Reason.PREFIX)  # no room anywhere: affinity stays
    assert ask(c, 2, 1) == ("w0", Reason.PREFIX)
    assert dict(c.router.homes.committed(c.now)) == {"w0": 12, "w1": 8}  # w0 overfull
    c.now = 10.5  # w1's prefixes (placed at 0) expired; w0's (placed at 5) live
    assert ask(c, 1, 2) == ("w1", Reason.SPILL)  # w0 holds it, but is full of others
    assert dict(c.router.homes.committed(c.now)) == {"w0": 8, "w1": 4}
    assert ask(c, 2, 2) == ("w0", Reason.PREFIX)  # the holder keeps the rest
    assert ask(c, 5, 1) == ("w0", Reason.PREFIX)
    # its new home holds it now; w0 (less loaded, still holding it) has no room for it
    assert ask(c, 1, 3) == ("w1", Reason.SPILL)
    assert ask(c, 1, 4, queues=(40, 0)) == ("w1", Reason.LOAD)
    assert c.router.metrics.count(Reason.SPILL) == 2


def test_a_first_touch_home_gives_way_to_its_shared_prefix() -> None:
    homes = PrefixHomes(ttl_s=10.0)
    system, q1, q2 = tokens(1, 64), tokens(2, 32), tokens(3, 32)
    first = block_keys(system + q1, BS)  # 6 blocks, nothing shared yet: all of it
    assert homes.prefix_of(first, 0, 5) == tuple(first[:5])
    homes.place(homes.prefix_of(first, 0, 5), "w0", 0.0, first=True)
    assert dict(homes.committed(0.0)) == {"w0": 5}
    second = block_keys(system + q2, BS)  # a sibling: 4 blocks shared with the first
    shared = homes.prefix_of(second, 4, 5)
    assert shared == tuple(second[:4]) and homes.fits(shared, "w0", 5, 1.0)
    homes.place(shared, "w1", 1.0, first=False)  # replaces the first touch's entry
    assert dict(homes.committed(1.0)) == {"w1": 4} and len(homes) == 1
    other = block_keys(tokens(1, 16) + tokens(9, 48), BS)  # shares only block 0
    homes.place(homes.prefix_of(other, 1, 3), "w0", 2.0, first=False)
    assert dict(homes.committed(2.0)) == {"w1": 4, "w0": 1}  # a shared entry never gives way
    assert dict(homes.committed(11.5)) == {"w0": 1} and dict(homes.committed(12.5)) == {}


def test_a_first_touch_is_committed_only_for_its_shorter_ttl() -> None:
    """A prompt nobody shares commits its whole size for ``first_ttl_s`` (the router's
    pending memory), not the hot prefixes' ``ttl_s``; a shared prefix keeps ``ttl_s``."""
    homes = PrefixHomes(ttl_s=30.0, first_ttl_s=10.0)
    one_off = block_keys(tokens(4, 96), BS)
    homes.place(homes.prefix_of(one_off, 0, 5), "w0", 0.0, first=True)
    hot = block_keys(tokens(5, 64) + tokens(6, 16), BS)
    homes.place(homes.prefix_of(hot, 4, 4), "w1", 0.0, first=False)
    assert dict(homes.committed(9.5)) == {"w0": 5, "w1": 4}
    assert dict(homes.committed(10.5)) == {"w1": 4}
    assert dict(homes.committed(30.5)) == {}
    assert PrefixHomes(ttl_s=5.0, first_ttl_s=10.0).first_ttl_s == 5.0  # never longer

"""The disk KV tier in the engine, on the real tiny Llama: evicted prefixes come back from
disk, a restarted engine on the same directory serves its first repeat from disk, and
corrupt, foreign or unwritable files never change a token (greedy outputs equal those of the
engine without the tier)."""

from __future__ import annotations

import errno
import logging
import random
from pathlib import Path

import pytest

from kvstore.blocks.events import BlockStored
from kvstore.blocks.tiers import Tier
from worker.engine import Engine, EngineConfig, SamplingParams
from worker.kv import disk_files
from worker.kv.disk_format import SUFFIX
from worker.kv.disk_tier import DiskTier

BS = 4
BLOCK_BYTES = 2048  # the tiny Llama's KV per block of 4 tokens (2 layers x K,V x 2 x 16 x f32)


def _prompts(seed: int = 0, n_prefixes: int = 6, rounds: int = 2) -> list[list[int]]:
    """``rounds`` over ``n_prefixes`` prefixes of 10 blocks, each with a distinct tail: the
    working set (60 blocks) is about 1.5 x device + host (32 + 8)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(2, 200) for _ in range(40)] for _ in range(n_prefixes)]
    return [p + [rng.randrange(2, 200) for _ in range(3)] for _ in range(rounds) for p in prefixes]


def _engine(model: Path, disk: Path | None, *, model_id: str = "m", **kw: object) -> Engine:
    cfg = EngineConfig(
        block_size=BS,
        num_blocks=32,
        host_kv_bytes=8 * BLOCK_BYTES,
        max_model_len=256,
        max_num_seqs=2,
        disk_kv_bytes=(1 << 20) if disk is not None else 0,
        disk_kv_path=str(disk) if disk is not None else "",
        **kw,  # type: ignore[arg-type]
    )
    return Engine.from_model_dir(model, cfg, model_id=model_id)


def _disk(engine: Engine) -> DiskTier:
    tier = engine.kv.tiers.get(Tier.DISK)
    assert isinstance(tier, DiskTier)
    return tier


def _serve(engine: Engine, prompts: list[list[int]], **params: object) -> list[list[int]]:
    """One request at a time, each after the disk writes of the ones before have landed."""
    p = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, **params)  # type: ignore[arg-type]
    out = []
    for prompt in prompts:
        out.append(engine.generate([prompt], p)[0].completions[0].token_ids)
        tier = engine.kv.tiers.get(Tier.DISK)
        if tier is not None:
            assert _disk(engine).disk.drain(10)
    return out


def _disk_hits(engine: Engine) -> int:
    return next(s.hit_tokens for s in engine.kv.stats().tiers if s.tier is Tier.DISK)


@pytest.fixture(scope="module")
def cold(tiny_dir: Path) -> dict[tuple[int, ...], list[int]]:
    """Greedy outputs of the engine without the disk tier, by prompt."""
    prompts = _prompts()
    engine = _engine(tiny_dir, None)
    return {tuple(p): o for p, o in zip(prompts, _serve(engine, prompts), strict=True)}


def _expected(cold: dict, prompts: list[list[int]]) -> list[list[int]]:
    return [cold[tuple(p)] for p in prompts]


def test_evicted_prefixes_come_back_from_disk_with_the_same_tokens(tiny_dir, tmp_path, cold):
    prompts = _prompts()
    engine = _engine(tiny_dir, tmp_path)
    assert _serve(engine, prompts) == _expected(cold, prompts)
    tiers = {s.tier: s for s in engine.kv.stats().tiers}
    disk = tiers[Tier.DISK]
    assert disk.hit_tokens > 0 and disk.read_blocks > 0 and disk.written_blocks > 0, disk
    assert disk.usage_bytes > 0 and disk.capacity_bytes == 1 << 20 and disk.enabled
    engine.kv.check_invariants()
    metrics = engine.metrics()  # the snapshot path: every lower tier's figures
    assert [s.tier for s in metrics.kv_tiers] == [Tier.HOST, Tier.DISK]
    by_tier = metrics.cached_tokens_by_tier()
    assert by_tier["disk"] == disk.hit_tokens and sum(by_tier.values()) == (
        metrics.prefix_hit_tokens
    )
    assert by_tier["device"] >= 0


def test_a_restarted_engine_announces_its_disk_and_serves_the_first_repeat_from_it(
    tiny_dir, tmp_path, cold
):
    prompts = _prompts()
    first = _engine(tiny_dir, tmp_path)
    _serve(first, prompts[:6])
    _disk(first).disk.close()
    again = _engine(tiny_dir, tmp_path)  # a new process would open the same directory
    announced = [e for e in again.drain_kv_events() if isinstance(e, BlockStored)]
    assert announced and all(e.tier is Tier.DISK for e in announced)
    assert announced[0].parent is None  # block 0 of a prompt first: the runs are prefix-closed
    assert _serve(again, prompts[:1]) == _expected(cold, prompts[:1])
    assert _disk_hits(again) >= 8 * BS  # most of the repeated prompt's 10 blocks


def test_corrupt_files_are_dropped_at_open_and_at_read_never_served(tiny_dir, tmp_path, cold):
    prompts = _prompts()
    _serve(_engine(tiny_dir, tmp_path), prompts[:6])
    files = sorted(p for p in tmp_path.iterdir() if p.name.endswith(SUFFIX))
    assert files
    _flip_last_byte(files[0])  # found by the scan at open: deleted
    engine = _engine(tiny_dir, tmp_path)
    assert not files[0].exists()
    for f in files[1:]:
        _flip_last_byte(f)  # found by the read that would load it
    assert _serve(engine, prompts[:6]) == _expected(cold, prompts[:6])
    disk = next(s for s in engine.kv.stats().tiers if s.tier is Tier.DISK)
    assert disk.failed_reads > 0, disk
    engine.kv.check_invariants()


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_foreign_model_or_tenant_blocks_are_never_used(tiny_dir, tmp_path, cold):
    prompts = _prompts()
    _serve(_engine(tiny_dir, tmp_path), prompts[:6])
    other_model = _engine(tiny_dir, tmp_path, model_id="another-model")
    assert not _disk(other_model).held  # files of another fingerprint: deleted at open
    assert _serve(other_model, prompts[:2]) == _expected(cold, prompts[:2])
    assert _disk_hits(other_model) == 0

    tenant_dir = tmp_path / "tenant"
    _serve(_engine(tiny_dir, tenant_dir), prompts[:6])
    engine = _engine(tiny_dir, tenant_dir)
    assert _disk(engine).held
    assert _serve(engine, prompts[:2], cache_salt="tenant-b") == _expected(cold, prompts[:2])
    assert _disk_hits(engine) == 0  # the salt is folded into block 0's key


@pytest.mark.parametrize("fault", ["unusable", "full"])
def test_an_unusable_or_full_disk_leaves_the_engine_host_only(
    tiny_dir, tmp_path, cold, caplog, monkeypatch, fault
):
    prompts = _prompts()
    path = tmp_path / "disk"
    if fault == "unusable":
        path.write_text("a file where the directory should be")
    else:

        def full(*args: object, **kw: object) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(disk_files, "write_durably", full)
    with caplog.at_level(logging.WARNING, logger="worker.kv.disk_store"):
        engine = _engine(tiny_dir, path)
        assert _serve(engine, prompts) == _expected(cold, prompts)
    off = [r for r in caplog.records if "disk KV tier off" in r.getMessage()]
    assert len(off) == 1, [r.getMessage() for r in caplog.records]
    disk = next(s for s in engine.kv.stats().tiers if s.tier is Tier.DISK)
    assert not disk.enabled and disk.hit_tokens == 0
    host = next(s for s in engine.kv.stats().tiers if s.tier is Tier.HOST)
    assert host.stored_blocks > 0
    engine.kv.check_invariants()


def test_disk_config_needs_a_path_a_host_tier_and_prefix_caching() -> None:
    with pytest.raises(ValueError, match="disk_kv_bytes=4096 needs disk_kv_path"):
        EngineConfig(disk_kv_bytes=4096, host_kv_bytes=4096)
    with pytest.raises(ValueError, match=r"host_kv_bytes=0.*set host_kv_bytes > 0"):
        EngineConfig(disk_kv_bytes=4096, disk_kv_path="/tmp/x")
    with pytest.raises(ValueError, match="disk_kv_admit_after"):
        EngineConfig(disk_kv_admit_after=3)  # type: ignore[arg-type]


def test_blocks_of_the_base_model_are_never_used_for_an_adapter(tiny_dir, tmp_path):
    from worker.model.build_tiny_lora import build_tiny_lora

    adapter = str(build_tiny_lora(tmp_path / "lora", tiny_dir, seed=1))
    prompts = _prompts()[:6]
    disk = tmp_path / "disk"
    _serve(_engine(tiny_dir, disk), prompts)  # the base model's blocks on disk
    expected = _serve(_engine(tiny_dir, None, lora_adapters={"a": adapter}), prompts, lora="a")
    engine = _engine(tiny_dir, disk, lora_adapters={"a": adapter})
    assert _disk(engine).held
    assert _serve(engine, prompts[:2], lora="a") == expected[:2]
    assert _disk_hits(engine) == 0  # the adapter id is folded into block 0's key

"""SamplingParams and EngineConfig validation: typed errors naming field, value and limit."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from worker.engine import EngineConfig, InvalidRequest, SamplingParams


@pytest.mark.parametrize(
    ("field", "value", "limit"),
    [
        ("max_tokens", 0, ">= 1"),
        ("min_tokens", 20, "[0, max_tokens=16]"),
        ("temperature", -0.1, ">= 0"),
        ("temperature", float("nan"), "finite"),
        ("top_k", -5, ">= 1"),
        ("top_p", 0.0, "(0, 1]"),
        ("top_p", 1.5, "(0, 1]"),
        ("min_p", 1.2, "[0, 1]"),
        ("seed", -1, "integer in [0,"),
        ("n", 0, "[1, 256]"),
        ("beam_width", 0, "1 = no beam search"),
        ("length_penalty", float("inf"), "finite"),
        ("early_stopping", "sometimes", "'never'"),
        ("stop", ("",), "non-empty"),
        ("stop_token_ids", (-1,), "non-negative"),
        ("logprobs", 21, "[0, 20]"),
        ("priority", 1.5, "integer"),
        ("cache_salt", "", "non-empty"),
        ("ignore_eos", "yes", "bool"),
    ],
)
def test_each_invalid_field_is_named(field, value, limit) -> None:
    with pytest.raises(InvalidRequest) as exc:
        SamplingParams(**{field: value})
    err = exc.value
    assert err.field == field
    assert err.value == value or (value != value and err.value != err.value)  # nan
    assert limit in err.limit
    assert field in str(err) and limit in str(err)


def test_beam_search_rules() -> None:
    with pytest.raises(InvalidRequest, match="beam_width=2") as exc:
        SamplingParams(beam_width=2, n=3)
    assert exc.value.field == "n"
    with pytest.raises(InvalidRequest) as exc:
        SamplingParams(beam_width=2, stop=["x"])
    assert exc.value.field == "stop"
    assert SamplingParams(beam_width=4, n=2).width == 4


def test_normalisation_and_properties() -> None:
    p = SamplingParams(stop="end", stop_token_ids=[3, 4], top_k=0, temperature=0)
    assert p.stop == ("end",) and p.stop_token_ids == (3, 4) and p.top_k is None
    assert p.is_greedy and not p.use_beam_search and p.width == 1
    assert SamplingParams(top_k=-1).top_k is None
    with pytest.raises(InvalidRequest, match="unknown field") as exc:
        SamplingParams.from_dict({"max_tokens": 3, "temprature": 0.5})
    assert exc.value.field == "temprature"
    assert SamplingParams.from_dict({"max_tokens": 3}).max_tokens == 3


def test_engine_config_is_strict() -> None:
    with pytest.raises(ValidationError, match="extra"):
        EngineConfig(max_num_seq=3)
    with pytest.raises(ValidationError, match="unknown policy 'lifo'; valid: fcfs, priority"):
        EngineConfig(policy="lifo")
    with pytest.raises(ValidationError, match="max_num_batched_tokens=8 < max_num_seqs=16"):
        EngineConfig(max_num_seqs=16, max_num_batched_tokens=8)
    with pytest.raises(ValidationError, match="not both"):
        EngineConfig(num_blocks=8, kv_memory_bytes=2**20)
    cfg = EngineConfig(max_num_batched_tokens=256, long_prefill_token_threshold=64)
    assert cfg.prefill_chunk_cap == 64
    with pytest.raises(ValidationError):
        cfg.max_num_seqs = 3  # frozen


def test_errors_survive_pickling() -> None:
    import pickle

    from worker.engine import EngineOverloaded

    err = pickle.loads(pickle.dumps(InvalidRequest("top_p", 2.0, "must be in (0, 1]", "fix it")))
    assert (err.field, err.value, err.limit, str(err)) == (
        "top_p",
        2.0,
        "must be in (0, 1]",
        "invalid top_p=2.0: must be in (0, 1]; fix it",
    )
    over = pickle.loads(pickle.dumps(EngineOverloaded(5, 5)))
    assert (over.num_waiting, over.max_waiting) == (5, 5) and "max_waiting=5" in str(over)

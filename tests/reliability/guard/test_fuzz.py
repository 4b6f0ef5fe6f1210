"""Property-based fuzz of GenerateRequest against the live server: whatever the fields
hold, the answer is OK, INVALID_ARGUMENT or RESOURCE_EXHAUSTED within the deadline, and the
server keeps serving. Bounded and derandomized, so CI runs the same examples every time."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protos.kvcluster.v1 import kvcluster_pb2 as pb
from tests.reliability.helpers import code_of, raw_generate

pytestmark = [pytest.mark.ray, pytest.mark.redis]

ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
DEADLINE_S = 30.0
FUZZ = settings(
    max_examples=80,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def mostly(good: st.SearchStrategy, bad: st.SearchStrategy, one_in: int = 6) -> st.SearchStrategy:
    """``good`` values, and one time in ``one_in`` a ``bad`` one: most requests are valid
    but for a field or two, so the fuzz reaches the workers, not only the first check."""
    return st.integers(0, one_in - 1).flatmap(lambda k: bad if k == one_in - 1 else good)


weird_floats = st.one_of(st.floats(width=32), st.sampled_from([-1.0, 0.0, 1e-9, 2.0, 1e30]))
params = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": mostly(st.integers(1, 12), st.integers(0, 2**32 - 1)),
        "min_tokens": mostly(st.integers(0, 1), st.integers(0, 2**32 - 1)),
        "temperature": mostly(st.floats(0, 2), weird_floats),
        "top_k": st.integers(0, 2**32 - 1),
        "top_p": mostly(st.floats(0.01, 1), weird_floats),
        "min_p": mostly(st.floats(0, 1), weird_floats),
        "seed": mostly(st.integers(0, 2**63 - 1), st.integers(0, 2**64 - 1)),
        "n": mostly(st.integers(1, 2), st.integers(0, 2**32 - 1)),
        "beam_width": mostly(st.just(1), st.integers(0, 300)),
        "length_penalty": mostly(st.floats(0, 2), weird_floats),
        "stop": mostly(
            st.lists(st.text(min_size=1, max_size=6), max_size=3),
            st.lists(st.text(max_size=300), max_size=20),
        ),
        "stop_token_ids": mostly(
            st.lists(st.integers(0, 511), max_size=3),
            st.lists(st.integers(0, 2**32 - 1), max_size=3),
        ),
        "ignore_eos": st.booleans(),
        "logprobs": mostly(st.integers(0, 5), st.integers(0, 2**32 - 1)),
    },
)
prompts = mostly(
    st.one_of(
        st.text(min_size=1, max_size=300).map(lambda t: {"text": t}),
        st.lists(st.integers(0, 511), min_size=1, max_size=80).map(
            lambda ids: {"token_ids": pb.TokenIds(ids=ids)}
        ),
    ),
    st.one_of(
        st.just({}),
        st.just({"text": ""}),
        st.lists(st.integers(0, 2**32 - 1), max_size=600).map(
            lambda ids: {"token_ids": pb.TokenIds(ids=ids)}
        ),
    ),
)
requests = st.builds(
    lambda prompt, p, **kw: pb.GenerateRequest(**prompt, params=pb.SamplingParams(**p), **kw),
    prompts,
    params,
    request_id=mostly(st.text(max_size=20), st.text(max_size=200)),
    cache_salt=mostly(st.text(max_size=20), st.text(max_size=300)),
    tenant=mostly(st.sampled_from(["", "alice"]), st.sampled_from(["bob", "mallory"])),
    priority=st.integers(-(2**31), 2**31 - 1),
    stream_text=st.booleans(),
)


@FUZZ
@given(request=requests)
def test_fuzzed_requests_get_allowed_codes(alice, request) -> None:
    code, details = code_of(lambda: list(alice.stream(request, timeout=DEADLINE_S)))
    assert code in ALLOWED, (code, details, request)


@FUZZ
@given(data=st.binary(max_size=96))
def test_fuzzed_bytes_get_allowed_codes(alice, data) -> None:
    code, details = code_of(
        lambda: raw_generate(alice.channel, data, metadata=alice.metadata, timeout=DEADLINE_S)
    )
    assert code in ALLOWED, (code, details, data)


def test_still_serving_after_fuzzing(alice) -> None:
    out = alice.generate("Fuzzing is over.", max_tokens=3, ignore_eos=True, timeout=DEADLINE_S)
    assert out.completion_tokens == 3

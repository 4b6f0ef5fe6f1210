"""Request limits come from one config section and name the field, value and limit."""

from __future__ import annotations

import pytest

from protos.kvcluster.v1 import kvcluster_pb2 as pb
from router.edge.convert import spec_from_pb
from router.placement.config import RequestLimits
from worker.engine import InvalidRequest

LIMITS = RequestLimits(max_n=4, max_stop_strings=2, max_request_id_chars=8, max_logprobs=3)


@pytest.mark.parametrize(
    ("req", "field", "limit"),
    [
        (pb.GenerateRequest(text="x", params=pb.SamplingParams(n=5)), "n", "at most 4"),
        (
            pb.GenerateRequest(text="x", params=pb.SamplingParams(beam_width=5)),
            "beam_width",
            "at most 4",
        ),
        (
            pb.GenerateRequest(text="x", params=pb.SamplingParams(logprobs=4)),
            "logprobs",
            "at most 3",
        ),
        (
            pb.GenerateRequest(text="x", params=pb.SamplingParams(stop=["a", "b", "c"])),
            "stop",
            "at most 2 strings",
        ),
        (pb.GenerateRequest(text="x", request_id="123456789"), "request_id", "at most 8"),
        # "#" separates a tenant from its salts: "a#<digest>" would be tenant a's salted KV
        (pb.GenerateRequest(text="x", tenant="a#0f"), "tenant", "must not contain '#'"),
        (pb.GenerateRequest(text="x", request_id="a\nb"), "request_id", "control characters"),
    ],
)
def test_configured_limits_are_enforced(req, field: str, limit: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        spec_from_pb(req, limits=LIMITS)
    assert info.value.field == field and limit in str(info.value)


def test_within_limits_passes_and_defaults_are_wider() -> None:
    req = pb.GenerateRequest(
        text="x", request_id="r1", params=pb.SamplingParams(n=4, stop=["a", "b"], logprobs=3)
    )
    spec = spec_from_pb(req, limits=LIMITS)
    assert spec.params.n == 4 and spec.params.stop == ("a", "b") and spec.request_id == "r1"
    spec_from_pb(pb.GenerateRequest(text="x", params=pb.SamplingParams(n=16)))  # default max_n


def test_penalties_cross_the_wire_and_are_bounded() -> None:
    params = pb.SamplingParams(presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.2)
    spec = spec_from_pb(pb.GenerateRequest(text="x", params=params))
    assert spec.params.presence_penalty == 0.5 and spec.params.frequency_penalty == -1.0
    assert spec.params.repetition_penalty == pytest.approx(1.2)
    for field, value in (
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
    ):
        with pytest.raises(InvalidRequest) as info:
            spec_from_pb(pb.GenerateRequest(text="x", params=pb.SamplingParams(**{field: value})))
        assert info.value.field == field


def test_final_usage_carries_host_tier_cached_tokens() -> None:
    from router.edge.convert import responses_from_output
    from worker.engine import CompletionDelta, RequestOutput, Usage

    out = RequestOutput("r", [CompletionDelta(0, "", [5])], True, Usage(40, 32, 1, 16))
    (msg,) = responses_from_output(out, worker_id="w0", stream_text=False)
    assert (msg.usage.cached_tokens, msg.usage.host_cached_tokens) == (32, 16)


def test_prompt_logprobs_ride_the_first_response() -> None:
    from kvstore.requests.outputs import TokenLogprob
    from router.edge.convert import responses_from_output
    from worker.engine import CompletionDelta, RequestOutput, Usage

    prompt = [None, TokenLogprob(4, -0.5, ((4, -0.5), (9, -1.0)))]
    first = RequestOutput("r", [CompletionDelta(0, "", [5])], False, Usage(2, 0, 1), None, prompt)
    (msg,) = responses_from_output(first, worker_id="w0", stream_text=False)
    assert [len(t.entries) for t in msg.prompt_logprobs] == [0, 3]  # own + 2 alternatives
    assert (msg.prompt_logprobs[1].entries[0].token_id, msg.token_ids) == (4, [5])
    later = RequestOutput("r", [CompletionDelta(0, "", [6])], True, Usage(2, 0, 2))
    (msg,) = responses_from_output(later, worker_id="w0", stream_text=False)
    assert not msg.prompt_logprobs

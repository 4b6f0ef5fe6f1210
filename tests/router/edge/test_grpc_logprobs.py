"""Log-probabilities asked for over gRPC come back on both calls: the generated tokens' on
each response (streamed) and on each Completion (unary), the prompt's (params.
prompt_logprobs) on the first response and on the GenerateResult. A real grpc.aio server on
a small serving core."""

from __future__ import annotations

from kvstore.requests.outputs import (
    CompletionDelta,
    FinishReason,
    RequestOutput,
    TokenLogprob,
    Usage,
)
from protos.kvcluster.v1 import kvcluster_pb2 as pb
from tests.router.edges import both_calls, grpc_servicer
from tests.router.http_api.test_http_hostile_bodies import Core as OneTokenCore
from tests.router.http_api.test_http_hostile_bodies import Tokenizer

PROMPT = [None, TokenLogprob(1, -0.25, ((1, -0.25), (2, -2.0)))]


class Core(OneTokenCore):
    """Answers token 7 with its logprob and the prompt's, as the engine does once asked."""

    async def generate(self, request_id, token_ids, params, *, tenant=None, continue_from=()):  # noqa: ANN001, ANN201, E501
        assert params.prompt_logprobs == 1 and params.logprobs == 1
        lp = [TokenLogprob(7, -0.5, ((7, -0.5),))]
        d = CompletionDelta(0, "x", [7], finish_reason=FinishReason.LENGTH, logprobs=lp)
        yield "w0", RequestOutput(request_id, [d], True, Usage(2, 0, 1), None, PROMPT)


def test_logprobs_and_prompt_logprobs_on_both_calls() -> None:
    svc = grpc_servicer(Core(), Tokenizer())
    params = pb.SamplingParams(max_tokens=1, logprobs=1, prompt_logprobs=1)
    req = pb.GenerateRequest(text="ab", params=params)

    (msg,), unary = both_calls(svc, req)
    for prompt in (msg.prompt_logprobs, unary.prompt_logprobs):
        assert [[e.token_id for e in t.entries] for t in prompt] == [[], [1, 1, 2]]
    (completion,) = unary.completions
    for lps in (msg.logprobs, completion.logprobs):
        assert [[(e.token_id, e.logprob) for e in t.entries] for t in lps] == [
            [(7, -0.5), (7, -0.5)]
        ]

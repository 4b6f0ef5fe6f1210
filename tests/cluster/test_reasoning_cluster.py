"""A reasoning model served by a real cluster (local Ray, redis-server, the tiny Qwen3 with
``<think>`` tokens and a Qwen3-like template, ``tests/thinking_model.py``), driven with the
official ``openai`` client: the worker starts a request's grammar after the reasoning and the
router answers the reasoning apart, whole and streamed."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from cluster.launcher import Cluster
from tests.cluster.conftest import cluster_config
from tests.embedded_ray import shared_ray
from tests.thinking_model import thinking_model
from worker.model.reasoning_markers import ReasoningMarkers
from worker.model.tokenizer import Tokenizer

pytestmark = [pytest.mark.ray, pytest.mark.redis]

CHOICES = ["red", "green", "blue"]
MESSAGES = [{"role": "user", "content": "Pick a colour."}]
OPEN = {"chat_template_kwargs": {"open_thinking": True}}  # the prompt opens the reasoning


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, ReasoningMarkers]]:
    path = thinking_model(tmp_path_factory)
    markers = ReasoningMarkers.of(Tokenizer.from_dir(path))
    assert markers is not None
    shared_ray()
    cfg = cluster_config(
        f"test-reasoning-{os.getpid()}",
        model={"path": str(path), "tiny_family": None},
        workers={"num_workers": 1},
    )
    with Cluster(cfg) as c:
        yield c, markers


@pytest.fixture
def oai(served: tuple[Cluster, ReasoningMarkers]) -> openai.OpenAI:
    url = served[0].http_endpoints[0] + "/v1"
    return openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)


def ask(oai: openai.OpenAI, model: str, bias: float, end: int, **extra: Any) -> Any:
    return oai.chat.completions.create(
        model=model,
        messages=MESSAGES,
        temperature=0,
        max_tokens=24,
        logit_bias={str(end): bias},
        extra_body={**OPEN, "return_token_ids": True, **extra},
    )


def test_the_grammar_constrains_the_answer_after_the_reasoning(
    served: tuple[Cluster, ReasoningMarkers], oai: openai.OpenAI
) -> None:
    end, model = served[1].end_id, served[0].model_id
    for bias in (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0):  # one that ends the reasoning at k >= 2
        free = ask(oai, model, bias, end)
        ids = free.choices[0].model_extra["token_ids"]
        if end in ids and ids.index(end) >= 2:
            break
    else:
        raise AssertionError("no bias ends the unconstrained reasoning at k >= 2")
    k = ids.index(end)
    constrained = ask(oai, model, bias, end, structured_outputs={"choice": CHOICES})
    got = constrained.choices[0]
    # the reasoning is the model's own, token for token; the answer is the grammar's
    assert got.model_extra["token_ids"][: k + 1] == ids[: k + 1]
    assert got.message.model_extra["reasoning"] == free.choices[0].message.model_extra["reasoning"]
    assert got.message.model_extra["reasoning"]
    assert got.message.content in CHOICES and got.finish_reason == "stop"
    assert constrained.usage.completion_tokens_details.reasoning_tokens == k + 1

    # streamed: the same reasoning and answer, in pieces
    chunks = list(
        oai.chat.completions.create(
            model=model,
            messages=MESSAGES,
            temperature=0,
            max_tokens=24,
            logit_bias={str(end): bias},
            stream=True,
            extra_body={**OPEN, "structured_outputs": {"choice": CHOICES}},
        )
    )
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    reasoning = "".join((d.model_extra or {}).get("reasoning") or "" for d in deltas)
    assert reasoning == got.message.model_extra["reasoning"]
    assert "".join(d.content or "" for d in deltas) == got.message.content


def test_thinking_switched_off_answers_under_the_grammar_from_the_first_token(
    served: tuple[Cluster, ReasoningMarkers], oai: openai.OpenAI
) -> None:
    r = oai.chat.completions.create(
        model=served[0].model_id,
        messages=MESSAGES,
        temperature=0,
        max_tokens=8,
        logit_bias={str(served[1].start_id): 10},  # <think> would come first, unconstrained
        extra_body={
            "chat_template_kwargs": {"enable_thinking": False},
            "structured_outputs": {"choice": CHOICES},
        },
    )
    msg = r.choices[0].message
    assert msg.content in CHOICES and msg.model_extra["reasoning"] is None
    assert r.usage.completion_tokens_details.reasoning_tokens == 0

"""What clients moving from vLLM expect of the HTTP API, against the package's real cluster
(local Ray, redis-server, tiny model with a ChatML template): vLLM's extra routes and
request fields, driven with the official ``openai`` client and real ``curl``, and
``/metrics`` read by Prometheus' own text parser."""

from __future__ import annotations

import json
import shutil
import subprocess
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.launcher import Cluster
from worker.model.default_model import resolve_default_model
from worker.model.tokenizer import Tokenizer

pytestmark = [pytest.mark.ray, pytest.mark.redis]
needs_curl = pytest.mark.skipif(shutil.which("curl") is None, reason="needs the curl binary")


@pytest.fixture(scope="module")
def base_url(cluster: Cluster) -> str:
    return cluster.http_endpoints[0]


@pytest.fixture(scope="module")
def tok(cluster: Cluster) -> Tokenizer:
    return Tokenizer.from_dir(cluster.model_path or resolve_default_model("llama"))


@pytest.fixture
def oai(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=60)


def curl(url: str, body: Any = None, *headers: str) -> tuple[str, Any]:
    """(response head, parsed JSON body) of one curl call (POST when ``body``)."""
    cmd = ["curl", "-sS", "-i", url]
    for h in ("Content-Type: application/json", *headers):
        cmd += ["-H", h]
    if body is not None:
        cmd += ["-d", json.dumps(body)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout
    head, _, text = out.partition("\n\n")  # text mode: \r\n read as \n
    return head, json.loads(text)


@needs_curl
def test_models_version_tokenize_detokenize(
    base_url: str, cluster: Cluster, tok: Tokenizer
) -> None:
    _, models = curl(base_url + "/v1/models")
    # other modules of the package may have registered adapters on the shared cluster
    (card,) = [c for c in models["data"] if c["id"] == cluster.model_id]
    assert card["id"] == cluster.model_id and card["root"] == cluster.model_id
    assert card["created"] > 1_700_000_000 and card["max_model_len"] == 512
    _, one = curl(base_url + "/v1/models/" + cluster.model_id)
    assert one == card
    head, missing = curl(base_url + "/v1/models/gpt-9")
    assert " 404" in head.splitlines()[0] and missing["error"]["code"] == "model_not_found"
    _, version = curl(base_url + "/version")
    assert version["version"]
    text = "Blocks are keyed by their prefix"
    _, t = curl(base_url + "/tokenize", {"prompt": text, "return_token_strs": True})
    assert t["tokens"] == tok.encode(text) and t["count"] == len(t["tokens"])
    assert t["max_model_len"] == 512 and len(t["token_strs"]) == t["count"]
    _, d = curl(base_url + "/detokenize", {"tokens": t["tokens"]})
    assert d["prompt"] == tok.decode(t["tokens"])
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello the"}]
    _, chat = curl(
        base_url + "/tokenize",
        {"messages": msgs, "add_generation_prompt": False, "continue_final_message": True},
    )
    assert tok.decode(chat["tokens"]).endswith("Hello the")  # the last turn is left open
    head, bad = curl(base_url + "/detokenize", {"tokens": [10**9]})
    assert " 400" in head.splitlines()[0] and bad["error"]["param"] == "tokens"


def test_completion_logprobs_hold_the_sampled_token(oai: openai.OpenAI, cluster: Cluster) -> None:
    """OpenAI/vLLM: top_logprobs has up to k+1 entries, the sampled token among them;
    logprobs=0 gives the sampled token alone; text_offset locates each token."""
    for k, temperature in ((0, 0.0), (1, 1.5), (3, 1.5)):
        lp = (
            oai.completions.create(
                model=cluster.model_id,
                prompt="The router places",
                max_tokens=12,
                temperature=temperature,
                seed=-7,  # OpenAI allows negative seeds
                logprobs=k,
                # token ids as the strings: two byte tokens may both decode to U+FFFD
                extra_body={"return_tokens_as_token_ids": True},
            )
            .choices[0]
            .logprobs
        )
        assert len(lp.tokens) == 12
        for i, (piece, top) in enumerate(zip(lp.tokens, lp.top_logprobs, strict=True)):
            assert piece in top and top[piece] == pytest.approx(lp.token_logprobs[i])
            assert max(1, k) <= len(top) <= k + 1
    text = oai.completions.create(
        model=cluster.model_id, prompt="The router places", max_tokens=12, logprobs=1
    ).choices[0]
    offsets = text.logprobs.text_offset
    assert len(offsets) == 12 and offsets[0] == 0
    steps = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
    assert steps == [len(p) for p in text.logprobs.tokens[:-1]]


@needs_curl
def test_echo_logprobs_score_the_prompt_as_lm_eval_does(
    oai: openai.OpenAI, base_url: str, cluster: Cluster, tok: Tokenizer
) -> None:
    """lm-eval's log-likelihood request (echo, logprobs, max_tokens=1) over prompt +
    continuation gives the continuation's tokens the logprobs they had when generated."""
    m, prompt = cluster.model_id, "Routers place requests where"
    ids = tok.encode(prompt)
    gen = oai.completions.create(
        model=m,
        prompt=ids,
        max_tokens=6,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    ).choices[0]
    cont = [int(t.removeprefix("token_id:")) for t in gen.logprobs.tokens]
    scored = oai.completions.create(
        model=m, prompt=ids + cont, max_tokens=1, temperature=0, echo=True, logprobs=1
    ).choices[0]
    lp = scored.logprobs
    n = len(ids) + len(cont)
    assert len(lp.tokens) == n + 1 and lp.token_logprobs[0] is None  # prompt, then 1 token
    assert lp.top_logprobs[0] is None and all(t is not None for t in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert scored.text.startswith(tok.decode(ids + cont))
    # the continuation scored as it was generated (prefill and decode agree to float noise)
    assert lp.token_logprobs[len(ids) : n] == pytest.approx(gen.logprobs.token_logprobs, abs=2e-3)
    # vLLM's prompt_logprobs: per prompt token, id -> {logprob, rank, decoded_token}
    body = {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 2}
    _, raw = curl(base_url + "/v1/completions", body)
    plp = raw["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for i, entry in enumerate(plp[1:], start=1):
        assert entry[str(ids[i])]["logprob"] <= 0 and 2 <= len(entry) <= 3
        assert {e["rank"] for e in entry.values()} >= {1, 2}


def test_generation_fields(oai: openai.OpenAI, cluster: Cluster, tok: Tokenizer) -> None:
    m, prompt = cluster.model_id, "Routers place requests where"
    plain = oai.completions.create(model=m, prompt=prompt, max_tokens=8, temperature=0)
    text = plain.choices[0].text
    echo = oai.completions.create(model=m, prompt=prompt, max_tokens=8, temperature=0, echo=True)
    assert echo.choices[0].text == prompt + text
    forced = tok.encode(" cache", add_special_tokens=False)[0]
    biased = oai.completions.create(
        model=m,
        prompt=prompt,
        max_tokens=4,
        temperature=0,
        logit_bias={str(forced): 100},
        logprobs=0,
        extra_body={"return_tokens_as_token_ids": True},
    ).choices[0]
    assert biased.logprobs.tokens == [f"token_id:{forced}"] * 4
    allowed = sorted({forced, *tok.encode(" a b c the", add_special_tokens=False)})
    kept_to = oai.completions.create(
        model=m,
        prompt=prompt,
        max_tokens=6,
        temperature=1.5,
        extra_body={"allowed_token_ids": allowed, "return_token_ids": True},
    ).choices[0]
    assert set(kept_to.token_ids) <= set(allowed) and len(kept_to.token_ids) == 6  # type: ignore[attr-defined]
    stop = text[2:5]
    assert stop and stop in text
    kept = oai.completions.create(
        model=m,
        prompt=prompt,
        max_tokens=8,
        temperature=0,
        stop=[stop],
        extra_body={"include_stop_str_in_output": True},
    ).choices[0]
    assert kept.text.endswith(stop) and kept.finish_reason == "stop"
    cut = oai.completions.create(model=m, prompt=prompt, max_tokens=8, temperature=0, stop=[stop])
    assert cut.choices[0].text == kept.text[: -len(stop)]
    short = oai.completions.create(
        model=m, prompt=prompt, max_tokens=1, extra_body={"truncate_prompt_tokens": 3}
    )
    assert short.usage.prompt_tokens == 3
    chunks = list(
        oai.completions.create(
            model=m,
            prompt=prompt,
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
        )
    )
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 5 and chunks[-1].usage.completion_tokens == 5


def test_chat_fields(oai: openai.OpenAI, cluster: Cluster) -> None:
    m = cluster.model_id

    def ask(messages: list[dict], **extra: Any) -> str:
        r = oai.chat.completions.create(
            model=m, messages=messages, max_completion_tokens=6, temperature=0, **extra
        )
        return r.choices[0].message.content

    user = {"role": "user", "content": "Name a colour."}
    system = ask([{"role": "system", "content": "Be brief."}, user])
    # developer is OpenAI's newer system: a template without it renders it as system
    assert ask([{"role": "developer", "content": "Be brief."}, user]) == system
    # fields newer SDKs send that do not change the output
    assert (
        ask(
            [{"role": "system", "content": "Be brief."}, user],
            store=False,
            metadata={"team": "kv"},
            service_tier="auto",
            parallel_tool_calls=False,
            response_format={"type": "text"},
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
        == system
    )
    cont = oai.chat.completions.create(
        model=m,
        messages=[user, {"role": "assistant", "content": "The colour is"}],
        max_completion_tokens=3,
        temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True},
    )
    assert cont.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as bad:  # the deprecated spelling of tools
        oai.chat.completions.create(model=m, messages=[user], functions=[{"name": "f"}])
    assert bad.value.body["param"] == "functions"


@needs_curl
def test_request_id_header_model_optional_unknown_fields_and_metrics(base_url: str) -> None:
    body = {"prompt": "Metrics count", "max_tokens": 3, "frobnicate": 1, "temperature": None}
    head, answer = curl(base_url + "/v1/completions", body, "X-Request-Id: abc-123")
    assert answer["id"] == "cmpl-abc-123" and "x-request-id: abc-123" in head.lower()
    assert answer["usage"]["completion_tokens"] == 3
    curl(base_url + "/v1/completions", body)  # the same unknown field again: counted twice
    out = subprocess.run(
        ["curl", "-sS", base_url + "/metrics"], capture_output=True, text=True, check=True
    ).stdout
    fams = {f.name: f for f in text_string_to_metric_families(out)}

    def total(name: str, suffix: str = "_total", **labels: str) -> float:
        return sum(
            s.value
            for s in fams[name].samples
            if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items())
        )

    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert {s.labels["worker"] for s in fams[gauge].samples} == {"worker-0", "worker-1"}
    assert all(0 <= s.value <= 1 for s in fams["vllm:kv_cache_usage_perc"].samples)
    assert total("vllm:prompt_tokens") > 0 and total("vllm:generation_tokens") >= 6
    assert total("vllm:prefix_cache_queries") >= total("vllm:prefix_cache_hits") >= 0
    for hist in ("time_to_first_token", "inter_token_latency", "e2e_request_latency"):
        assert total(f"vllm:{hist}_seconds", "_count") >= 2, hist
    assert total("kvc_http_unknown_fields", field="frobnicate") == 2
    assert total("kvc_request_errors", status="404") >= 1  # /v1/models/gpt-9 above
    assert total("kvc_routed_requests") >= 2 and "kvc_router_retries" in fams


def test_max_tokens_over_what_the_prompt_leaves_is_refused_and_an_unset_one_fitted(
    oai: openai.OpenAI, cluster: Cluster, tok: Tokenizer
) -> None:
    """As vLLM answers: 400 naming the field as sent, the context length and the prompt's
    tokens; without max_tokens the default is cut to the room (the model's max_model_len is
    512 here)."""
    m, prompt = cluster.model_id, [tok.encode("Count on.")[-1]] * 500  # 12 tokens of room
    with pytest.raises(openai.BadRequestError) as bad:
        oai.completions.create(model=m, prompt=prompt, max_tokens=13)
    assert bad.value.body["param"] == "max_tokens"
    assert "must be at most 12: max_model_len=512 minus the prompt's 500 tokens" in str(bad.value)
    fitted = oai.completions.create(
        model=m, prompt=prompt, temperature=0, extra_body={"ignore_eos": True}
    )
    assert fitted.usage.completion_tokens == 12 and fitted.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as bad:
        oai.chat.completions.create(
            model=m, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=600
        )
    assert bad.value.body["param"] == "max_completion_tokens"


def test_responses_api_answers_as_the_chat_does(oai: openai.OpenAI, cluster: Cluster) -> None:
    """The same conversation through /v1/responses and /v1/chat/completions, greedy: the
    same prompt, the same answer, whole and streamed, and continued from the kept one."""
    m, ask = cluster.model_id, "Name a colour."
    chat = oai.chat.completions.create(
        model=m,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": ask}],
        max_completion_tokens=8,
        temperature=0,
    )
    r = oai.responses.create(
        model=m, instructions="Be brief.", input=ask, max_output_tokens=8, temperature=0
    )
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    with oai.responses.stream(
        model=m,
        instructions="Be brief.",
        input=[{"role": "user", "content": [{"type": "input_text", "text": ask}]}],
        max_output_tokens=8,
        temperature=0,
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
    assert "".join(deltas) == r.output_text
    # kept in the cluster's Redis: the next turn continues it
    turns = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": ask},
        {"role": "assistant", "content": r.output_text},
        {"role": "user", "content": "Another."},
    ]
    chat = oai.chat.completions.create(
        model=m, messages=turns, max_completion_tokens=8, temperature=0
    )
    more = oai.responses.create(
        model=m,
        instructions="Be brief.",
        input="Another.",
        previous_response_id=r.id,
        max_output_tokens=8,
        temperature=0,
    )
    assert more.output_text == chat.choices[0].message.content
    assert more.usage.input_tokens == chat.usage.prompt_tokens
    assert oai.responses.retrieve(more.id).output_text == more.output_text

"""The router's cache funnel, cached tokens by source tier, SLO attainment and the other
``/metrics`` series beside vLLM's: exact counts from hand-made decisions and outputs."""

from __future__ import annotations

from dataclasses import replace

from prometheus_client.parser import text_string_to_metric_families

from kvstore.blocks.tiers import Tier
from kvstore.requests.outputs import CompletionDelta, FinishReason, RequestOutput, Usage
from kvstore.requests.protocol import PullReport
from router.placement.cached import held_anywhere
from router.placement.placement_types import Reason, RouteDecision
from router.serving.cache_funnel import CacheFunnel
from router.serving.request_phases import RequestPhases
from router.serving.serving_metrics import ServingMetrics
from router.serving.slo import SloBounds
from tests.kvstore.helpers import tiers
from tests.router.serving.test_status_surfaces import STATUS, predictions


def decision(held: int, best: int, chosen: int) -> RouteDecision:
    return RouteDecision(
        worker_id="w0",
        policy="prefix_affinity",
        reason=Reason.PREFIX,
        cached_tokens_expected=chosen,
        decision_latency_s=0.0,
        held_tokens=held,
        best_cached_tokens=best,
    )


def test_held_anywhere_takes_the_best_holder_capped_like_a_hit() -> None:
    assert held_anywhere(None, 100, 16) == 0
    assert held_anywhere({"a": tiers(2, 1), "b": tiers(1)}, 100, 16) == 48
    assert held_anywhere({"a": tiers(9)}, 65, 16) == 64  # the last prompt token is computed


def test_funnel_stages_and_source_tiers() -> None:
    f = CacheFunnel()
    f.observe(decision(96, 64, 64), Usage(128, 64, 0, host_cached_tokens=16), None)
    pulled = PullReport("w1", "ok", 2, 32, 0.01)
    f.observe(decision(32, 32, 32), Usage(64, 32, 0), pulled)
    assert f.tokens == {"prompt": 192, "held": 128, "best": 96, "chosen": 96, "realised": 96}
    assert f.requests == 2
    by_tier = {t: n for t, n in f.cached_by_tier.items() if n}
    assert by_tier == {Tier.DEVICE: 48, Tier.HOST: 16, Tier.PEER: 32}


def families(m: ServingMetrics) -> dict[str, dict[tuple, float]]:
    out: dict[str, dict[tuple, float]] = {}
    status = replace(STATUS, swap_preemptions=2, recompute_preemptions=1)
    for fam in text_string_to_metric_families(m.render([status]).decode()):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_metrics_export_the_funnel_tiers_predictions_and_preemptions() -> None:
    m = ServingMetrics("m")
    funnel = CacheFunnel()
    funnel.observe(decision(96, 64, 64), Usage(128, 64, 0, host_cached_tokens=16), None)
    m.read_core(funnel, predictions())
    fams = families(m)
    stages = {k[0][1]: v for k, v in fams["kvc_cache_funnel_tokens_total"].items()}
    assert stages == {"prompt": 128, "held": 96, "best": 64, "chosen": 64, "realised": 64}
    tiers = {k[0][1]: v for k, v in fams["kvc_prompt_tokens_cached_total"].items()}
    assert tiers == {"device": 48, "host": 16, "disk": 0, "peer": 0}
    assert fams["kvc_pulled_tokens_total"] == {(("worker", "w0"),): 48}
    assert fams["kvc_cache_prediction_misses_total"] == {(("worker", "w0"),): 2}
    w0 = (("model_name", "m"), ("worker", "w0"))
    assert fams["vllm:num_preemptions_total"] == {w0: 3}
    assert fams["kvc_worker_preemptions_total"][(("mode", "swap"), *w0)] == 2


def test_slo_attainment_is_counted_per_request_and_token() -> None:
    m = ServingMetrics("m", slo=SloBounds(ttft_s=10.0, itl_s=1e-9))
    timer = m.tracker()
    delta = CompletionDelta(0, "ab", [1, 2])
    timer.output("w0", RequestOutput("r", [delta], False, Usage(4, 0, 2)))
    end = CompletionDelta(0, "c", [3], finish_reason=FinishReason.LENGTH)
    timer.output("w0", RequestOutput("r", [end], True, Usage(4, 0, 3)))
    fams = families(m)
    met = {k[0][1]: v for k, v in fams["kvc_slo_met_total"].items()}
    seen = {k[0][1]: v for k, v in fams["kvc_slo_observed_total"].items()}
    assert seen == {"ttft": 1, "itl": 2}
    assert met == {"ttft": 1, "itl": 1}  # the gap inside the first message is 0
    bounds = {k[0][1]: v for k, v in fams["kvc_slo_bound_seconds"].items()}
    assert bounds == {"ttft": 10.0, "itl": 1e-9}


def test_requests_are_counted_by_phase() -> None:
    phases = RequestPhases()
    a = phases.move(None, "routing")
    b = phases.move(phases.move(None, "routing"), "submitting")
    a = phases.move(a, "first_token")
    assert phases.counts == {"routing": 0, "submitting": 1, "first_token": 1, "streaming": 0}
    phases.move(phases.move(a, "streaming"), None)
    phases.move(b, None)
    m = ServingMetrics("m")
    m.read_core(CacheFunnel(), None, phases)
    phases.move(None, "routing")
    fams = families(m)
    assert {k[0][1]: v for k, v in fams["kvc_router_requests"].items()} == {
        "routing": 1, "submitting": 0, "first_token": 0, "streaming": 0,
    }  # fmt: skip

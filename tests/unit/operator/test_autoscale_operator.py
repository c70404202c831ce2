"""The operator running the autoscaler: metric names per engine, the planner's inputs from two scrapes,
one decision per pass (status, events), the rollout holding it, and the count reaching the same
create-and-drain path a spec edit takes; the runner's edges with fakes (no cluster, no HTTP)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdfleet_operator.api.constants import Role
from pdfleet_operator.api.models import PDDeploymentSpec, PDDeploymentStatus
from pdfleet_operator.autoscale import runner as runner_mod
from pdfleet_operator.autoscale.decide import ROLLOUT_IN_PROGRESS, decide
from pdfleet_operator.autoscale.inputs import (
    RoleScrape,
    decode_metrics,
    histogram_quantile,
    prefill_metrics,
    role_fleet,
)
from pdfleet_operator.autoscale.planner import Reason
from pdfleet_operator.autoscale.replicas import replicas_in_effect, rollout_in_progress, with_replicas
from pdfleet_operator.autoscale.signals import DecodeMetrics, PrefillMetrics, RoleFleet
from pdfleet_operator.autoscale.sources import Key, PodSample, parse_sample
from pdfleet_operator.observed import ObservedPod
from pdfleet_operator.plan import ActionKind, Owner, Snapshot, plan
from pdfleet_operator.resources.revision import role_revision
from pdfleet_operator.watched import View

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "valid" / "autoscaling.yaml"
OWNER = Owner(name="demo", namespace="ns", uid="uid-1")


def spec_of(**autoscaling: Any) -> PDDeploymentSpec:
    raw = yaml.safe_load(EXAMPLE.read_text())["spec"]
    raw["autoscaling"].update(autoscaling)
    return PDDeploymentSpec.model_validate(raw)


SGLANG_TEXT = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m",engine_type="decode"} 12.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m",engine_type="decode"} 3.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m"} 0.5
# TYPE sglang:num_used_tokens gauge
sglang:num_used_tokens{model_name="m"} 5000.0
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{model_name="m"} 10000.0
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="m"} 4000.0
# TYPE sglang:num_requests_total counter
sglang:num_requests_total{model_name="m"} 40.0
# TYPE sglang:inter_token_latency_seconds histogram
sglang:inter_token_latency_seconds_bucket{le="0.01",model_name="m"} 10.0
sglang:inter_token_latency_seconds_bucket{le="0.05",model_name="m"} 90.0
sglang:inter_token_latency_seconds_bucket{le="+Inf",model_name="m"} 100.0
sglang:inter_token_latency_seconds_count{model_name="m"} 100.0
sglang:inter_token_latency_seconds_sum{model_name="m"} 2.0
"""

VLLM_TEXT = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 7.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m"} 0.25
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="1000"} 1.0
# TYPE vllm:request_success_total counter
vllm:request_success_total{finished_reason="stop",model_name="m"} 5.0
vllm:request_success_total{finished_reason="length",model_name="m"} 3.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="1.0",model_name="m"} 4.0
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 4.0
vllm:time_to_first_token_seconds_count{model_name="m"} 4.0
vllm:time_to_first_token_seconds_sum{model_name="m"} 2.0
"""


def test_sglang_and_builtin_names_are_read() -> None:
    s = parse_sample(SGLANG_TEXT)
    assert s.values[Key.RUNNING] == 12 and s.values[Key.QUEUED] == 3
    assert s.values[Key.KV_USED_TOKENS] == 5000 and s.values[Key.KV_CAPACITY_TOKENS] == 10000
    assert s.values[Key.PROMPT_TOKENS] == 4000 and s.values[Key.REQUESTS_FINISHED] == 40
    assert s.histograms[Key.ITL][-1] == (float("inf"), 100.0)


def test_vllm_names_are_read_and_kv_tokens_derived_from_the_cache_config() -> None:
    s = parse_sample(VLLM_TEXT)
    assert s.values[Key.RUNNING] == 7 and s.values[Key.QUEUED] == 1
    assert s.values[Key.KV_CAPACITY_TOKENS] == 16000 and s.values[Key.KV_USED_TOKENS] == 4000
    assert s.values[Key.REQUESTS_FINISHED] == 8  # summed over label sets
    assert Key.TTFT in s.histograms


def test_unreadable_text_raises() -> None:
    with pytest.raises(ValueError):
        parse_sample("this is { not prometheus\n")


def test_histogram_quantile_interpolates_as_prometheus_does() -> None:
    b = ((0.01, 10.0), (0.05, 90.0), (float("inf"), 100.0))
    assert histogram_quantile(0.5, b) == pytest.approx(0.01 + 0.04 * 40 / 80)
    assert histogram_quantile(0.99, b) == 0.05  # the +Inf bucket answers the highest finite bound
    assert histogram_quantile(0.5, ((1.0, 0.0), (float("inf"), 0.0))) is None


def sample(**values: float) -> PodSample:
    return PodSample({Key(k): v for k, v in values.items()})


def test_prefill_rates_come_from_two_scrapes_and_the_queue_growth() -> None:
    prev = RoleScrape(100.0, {"p0": sample(queuedPromptTokens=1000, promptTokens=10_000, requestsFinished=10,
                                            prefillBusySeconds=5, queued=1)})
    cur = RoleScrape(110.0, {"p0": sample(queuedPromptTokens=3000, promptTokens=30_000, requestsFinished=30,
                                           prefillBusySeconds=9, queued=3)})
    m = prefill_metrics(prev, cur)
    assert m.queued_prompt_tokens == 3000
    assert m.prompt_tokens_per_second == pytest.approx((20_000 + 2000) / 10)  # processed + the queue's growth
    assert m.requests_per_second == pytest.approx((20 + 2) / 10)
    assert m.prefill_tokens_per_second == pytest.approx(20_000 / 4)  # tokens per busy second
    first = prefill_metrics(None, cur)  # after a restart: levels, no rates
    assert first.queued_prompt_tokens == 3000 and first.prompt_tokens_per_second is None


def test_a_counter_that_went_down_restarted_and_a_new_pod_adds_no_rate() -> None:
    prev = RoleScrape(0.0, {"p0": sample(promptTokens=50_000, requestsFinished=50, queued=0)})
    cur = RoleScrape(10.0, {"p0": sample(promptTokens=1000, requestsFinished=1, queued=0),
                            "p1": sample(promptTokens=99_999, requestsFinished=99, queued=0)})
    m = prefill_metrics(prev, cur)
    assert m.prompt_tokens_per_second == pytest.approx(100.0)  # p0 restarted: 1000 since; p1 unseen before
    # Without pdfleet_queued_prompt_tokens (an SGLang engine) the queue is queued requests x mean prompt.
    assert m.queued_prompt_tokens == 0


def test_decode_metrics_sum_the_role_and_read_the_interval_histogram() -> None:
    h0 = ((0.01, 5.0), (0.1, 10.0), (float("inf"), 10.0))
    h1 = ((0.01, 5.0), (0.1, 20.0), (float("inf"), 20.0))  # every ITL of the interval was in (0.01, 0.1]
    prev = RoleScrape(0.0, {"d0": PodSample({Key.REQUESTS_FINISHED: 10}, {Key.ITL: h0})})
    cur = RoleScrape(10.0, {
        "d0": PodSample({Key.REQUESTS_FINISHED: 30, Key.RUNNING: 4, Key.QUEUED: 1, Key.KV_USED_TOKENS: 100,
                         Key.KV_CAPACITY_TOKENS: 1000}, {Key.ITL: h1}),
        "d1": PodSample({Key.RUNNING: 6, Key.QUEUED: 0, Key.KV_USED_TOKENS: 300, Key.KV_CAPACITY_TOKENS: 1000})})
    from pdfleet_operator.api.autoscaling import Percentile
    m = decode_metrics(prev, cur, Percentile.P50)
    assert (m.running_requests, m.queued_requests, m.kv_used_tokens, m.kv_tokens_per_replica) == (10, 1, 400, 1000)
    assert m.requests_per_second == pytest.approx(2.0)
    assert m.itl_seconds == pytest.approx(0.01 + 0.09 * 0.5)


def pod(name: str, role: Role, rev: str, index: int, ready: bool = False, **kw: Any) -> ObservedPod:
    return ObservedPod(name, role, rev, index, ready, **kw)


def test_fleet_measures_the_start_up_time_and_counts_starting_and_draining() -> None:
    pods = [pod("d0", Role.DECODE, "r", 0, ready=True, created=0.0, ready_since=40.0),
            pod("d1", Role.DECODE, "r", 1, ready=True, created=10.0, ready_since=70.0),
            pod("d2", Role.DECODE, "r", 2, ready=False, created=90.0),
            pod("d3", Role.DECODE, "r", 3, ready=True, drain_started=95.0)]
    f = role_fleet(pods, 3, now=100.0, gpus_per_replica=2)
    assert (f.ready, f.starting, f.draining, f.startup_seconds) == (2, (10.0,), 1, 50.0)
    assert role_fleet([], 1, now=0.0, gpus_per_replica=1).startup_seconds == 120.0  # nothing measured yet


BUSY = (PrefillMetrics(queued_prompt_tokens=200_000, prompt_tokens_per_second=30_000, requests_per_second=10),
        RoleFleet(replicas=1, ready=1, startup_seconds=30, gpus_per_replica=4))
QUIET = (DecodeMetrics(kv_used_tokens=10, kv_tokens_per_replica=100_000, running_requests=1, requests_per_second=1),
         RoleFleet(replicas=2, ready=2, startup_seconds=30, gpus_per_replica=2))


def test_a_decision_is_recorded_in_status_and_as_an_event() -> None:
    spec = spec_of()
    assert spec.autoscaling is not None
    out = decide(spec.autoscaling, 1000.0, BUSY, QUIET, None)
    p = out.status.prefill
    assert p is not None and p.desired > 1 and p.reason == Reason.SIGNAL_ABOVE_TARGET.value
    assert p.readings and p.readings[0].signal == "backlogSeconds" and p.last_scale_up == 1000.0
    assert p.recommendations and p.recommendations[-1].at == 1000.0
    assert out.status.gpus == p.desired * 4 + out.desired(Role.DECODE) * 2 <= 64
    prefill_events = [e for e in out.events if e.role is Role.PREFILL]
    assert prefill_events and f"1 -> {p.desired}" in prefill_events[0].message
    # The status round-trips through the CRD's model (the runner writes exactly this document).
    doc = out.status.model_dump(by_alias=True, mode="json", exclude_none=True)
    back = PDDeploymentStatus.model_validate({"autoscaling": doc}).autoscaling
    assert back == out.status
    # Next pass, same readings: the planner's memory came back from status, and no event repeats.
    again = decide(spec.autoscaling, 1015.0, (BUSY[0], RoleFleet(p.desired, 1, (15.0,) * (p.desired - 1), 0, 30, 4)),
                   QUIET, back)
    assert again.status.prefill is not None and again.status.prefill.last_scale_up == 1000.0
    assert not [e for e in again.events if e.role is Role.PREFILL and "scale up" in e.message]


def test_a_rollout_in_progress_wins_and_the_autoscaler_holds() -> None:
    spec = spec_of()
    assert spec.autoscaling is not None
    out = decide(spec.autoscaling, 1000.0, BUSY, QUIET, None, rollout="a rollout is in progress (1 decode pod)")
    for role in Role:
        s = out.status.prefill if role is Role.PREFILL else out.status.decode
        assert s is not None and s.desired == s.current and s.reason == ROLLOUT_IN_PROGRESS
        assert s.last_scale_up is None and s.last_scale_down is None  # no growth happened
    assert out.status.held_by_rollout
    assert out.status.prefill is not None and "would go 1 ->" in out.status.prefill.message
    assert out.status.prefill.recommendation is not None and out.status.prefill.recommendation > 1
    assert {e.reason for e in out.events} == {ROLLOUT_IN_PROGRESS}
    # Once the rollout is done the same readings scale up at once (the held pass opened no window).
    after = decide(spec.autoscaling, 1015.0, BUSY, QUIET, out.status)
    assert after.status.prefill is not None and after.status.prefill.desired > 1
    assert not after.status.held_by_rollout


def test_rollout_in_progress_is_a_pod_of_another_revision() -> None:
    spec = spec_of()
    rev = role_revision(spec, Role.DECODE)
    assert rollout_in_progress(spec, [pod("d0", Role.DECODE, rev, 0, ready=True)]) is None
    why = rollout_in_progress(spec, [pod("d0", Role.DECODE, rev, 0), pod("d1", Role.DECODE, "old", 1,
                                                                          drain_started=1.0)])
    assert why is not None and "1 decode pod of an older revision" in why
    assert rollout_in_progress(spec, [pod("d1", Role.DECODE, "old", 1, deleting=True)]) is None


def test_the_count_in_effect_has_one_owner() -> None:
    spec = spec_of()
    assert replicas_in_effect(spec, None) == {Role.PREFILL: 1, Role.DECODE: 2}  # before the first decision
    out = decide(spec.autoscaling, 1000.0, BUSY, QUIET, None)  # type: ignore[arg-type]
    status = PDDeploymentStatus(autoscaling=out.status)
    assert replicas_in_effect(spec, status)[Role.PREFILL] == out.desired(Role.PREFILL)
    assert replicas_in_effect(spec, status, {Role.PREFILL: 7})[Role.PREFILL] == out.desired(Role.PREFILL)
    narrowed = spec_of(prefill={**yaml.safe_load(EXAMPLE.read_text())["spec"]["autoscaling"]["prefill"],
                                "maxReplicas": 1})
    assert replicas_in_effect(narrowed, status)[Role.PREFILL] == 1  # a bound moved: it wins at once
    plain = spec.model_copy(update={"autoscaling": None})
    assert replicas_in_effect(plain, status) == {Role.PREFILL: 1, Role.DECODE: 2}
    assert replicas_in_effect(plain, None, {Role.DECODE: 5}) == {Role.PREFILL: 1, Role.DECODE: 5}


def test_a_lower_count_reaches_the_reconcile_as_drains_never_deletes() -> None:
    """The autoscaler's count takes the spec-edit path: surplus pods drain first (not-ready, then the
    highest index), and none is deleted before it reports drained."""
    spec = spec_of()
    rev = role_revision(spec, Role.DECODE)
    prev = rev_p = role_revision(spec, Role.PREFILL)
    pods = (pod("p0", Role.PREFILL, rev_p, 0, ready=True),
            *(pod(f"d{i}", Role.DECODE, rev, i, ready=True) for i in range(4)))
    del prev
    status = PDDeploymentStatus.model_validate({"autoscaling": {
        "prefill": {"desired": 1, "reason": "WithinTarget"}, "decode": {"desired": 2, "reason": "SignalBelowTarget"}}})
    effective = with_replicas(spec, replicas_in_effect(spec, status))
    assert effective.decode.replicas == 2 and role_revision(effective, Role.DECODE) == rev  # not a rollout
    actions = plan(OWNER, effective, Snapshot(pods=pods, secret_exists=True, router_secret_exists=True,
                                              worker_secret_exists=True), now=100.0)
    drains = [a.name for a in actions if a.kind is ActionKind.PATCH_META]
    assert drains and set(drains) <= {"d2", "d3"}
    assert not [a for a in actions if a.kind is ActionKind.DELETE and a.object_kind == "Pod"]
    up = with_replicas(spec, {Role.PREFILL: 1, Role.DECODE: 5})
    created = [a for a in plan(OWNER, up, Snapshot(pods=pods, secret_exists=True, router_secret_exists=True,
                                                   worker_secret_exists=True), now=100.0)
               if a.kind is ActionKind.CREATE and a.object_kind == "Pod"]
    assert [a.name for a in created] and all("decode" in a.name for a in created)


# -- the runner's edges, with fakes -------------------------------------------------------------------------


class FakeState:
    def __init__(self, body: dict, pods: list[dict]) -> None:
        self.body, self.pods = body, pods
        self.written: list[dict] = []

    def view(self, namespace: str, name: str) -> View:
        return View(body=self.body, objects={"Pod": {p["metadata"]["name"]: p for p in self.pods}})

    def wrote(self, kind: str, namespace: str, deployment: str, obj: dict, *, deleted: bool = False) -> None:
        self.written.append(obj)


class FakeWriter:
    def __init__(self, body: dict) -> None:
        self.body = body
        self.patches: list[dict] = []

    def patch_status(self, namespace: str, name: str, status: dict) -> dict:
        self.patches.append(status)
        self.body.setdefault("status", {}).update(status)
        return self.body


class FakeScraper:
    def __init__(self, by_url: dict[str, str]) -> None:
        self.by_url = by_url
        self.asked: list[tuple[str, str]] = []

    async def scrape(self, targets):  # type: ignore[no-untyped-def]
        pairs = list(targets)
        self.asked += pairs
        return {n: parse_sample(self.by_url[u]) for n, u in pairs if u in self.by_url}

    async def close(self) -> None:
        pass


def pod_body(name: str, role: Role, rev: str, index: int, ip: str) -> dict:
    return {"metadata": {"name": name, "uid": f"u-{name}", "creationTimestamp": "2026-01-01T00:00:00Z",
                         "ownerReferences": [{"uid": OWNER.uid, "name": OWNER.name, "controller": True}],
                         "labels": {}, "annotations": {"pdfleet.io/identity": f"{role.value}/{rev}/{index}"}},
            "spec": {"nodeName": "n"},
            "status": {"phase": "Running", "podIP": ip, "conditions": [
                {"type": "Ready", "status": "True", "lastTransitionTime": "2026-01-01T00:00:30Z"}]}}


def test_the_runner_scrapes_decides_writes_status_posts_events_and_wakes_the_reconcile(monkeypatch) -> None:
    spec = spec_of()
    body = {"metadata": {"name": OWNER.name, "namespace": OWNER.namespace, "uid": OWNER.uid},
            "spec": spec.model_dump(by_alias=True, mode="json", exclude_none=True)}
    pods = [pod_body("p0", Role.PREFILL, role_revision(spec, Role.PREFILL), 0, "10.0.0.1"),
            pod_body("d0", Role.DECODE, role_revision(spec, Role.DECODE), 0, "10.0.0.2"),
            pod_body("d1", Role.DECODE, role_revision(spec, Role.DECODE), 1, "10.0.0.3")]
    prefill_text = "# TYPE pdfleet_queued_prompt_tokens gauge\npdfleet_queued_prompt_tokens 500000\n"
    scraper = FakeScraper({"http://10.0.0.1:8090/metrics": prefill_text,
                           "http://10.0.0.2:8090/metrics": SGLANG_TEXT})  # d1 does not answer
    state, writer, woken, events = FakeState(body, pods), FakeWriter(body), [], []
    monkeypatch.setattr(runner_mod.kopf, "info", lambda obj, reason, message: events.append((reason, message)))
    a = runner_mod.Autoscaler(object(), state, woken.append, scraper=scraper, writer=writer)  # type: ignore[arg-type]
    out = asyncio.run(a.run(OWNER.namespace, OWNER.name))
    assert out is not None and out.status.prefill is not None
    assert {u for _, u in scraper.asked} == {f"http://10.0.0.{i}:8090/metrics" for i in (1, 2, 3)}
    assert out.status.prefill.scraped == 1 and out.status.decode is not None and out.status.decode.scraped == 1
    assert out.status.prefill.startup_seconds == 30.0  # create -> Ready, measured from the pod
    assert writer.patches and set(writer.patches[0]) == {"autoscaling"}  # only its own key of status
    assert state.written  # laid over the watched state for the next reconcile pass
    if out.desired(Role.PREFILL) != 1:
        assert woken == [(OWNER.namespace, OWNER.name)]
        assert any("prefill scale up 1 ->" in m for _, m in events), events
    # No spec.autoscaling: nothing is scraped or written.
    body["spec"].pop("autoscaling")
    scraper.asked.clear()
    assert asyncio.run(a.run(OWNER.namespace, OWNER.name)) is None and not scraper.asked


def test_the_operator_registers_one_autoscale_timer_per_deployment_with_autoscaling() -> None:
    import kopf

    from pdfleet_operator import handlers
    from pdfleet_operator.settings import OperatorSettings

    registry = kopf.OperatorRegistry()
    handlers.register(registry, OperatorSettings(autoscale_interval_seconds=7), kopf.OperatorSettings())
    timers = [h for h in registry._spawning.get_all_handlers() if h.id == "autoscale"]
    assert len(timers) == 1 and timers[0].interval == 7
    assert timers[0].when is not None and timers[0].when(spec={"autoscaling": {"prefill": {}}}) is True
    assert timers[0].when(spec={}) is False


def test_every_scrape_has_a_deadline_and_a_bad_answer_leaves_the_pod_out() -> None:
    """A pod that answers slowly is cut at the deadline, an error or unreadable text is left out, and the
    pods that answered count (a real HTTP server on the loopback)."""
    from aiohttp import web

    from pdfleet_operator.autoscale.scrape import Scraper

    async def main() -> tuple[dict, float]:
        async def good(_: web.Request) -> web.Response:
            return web.Response(text=SGLANG_TEXT)

        async def slow(_: web.Request) -> web.Response:
            await asyncio.sleep(2)
            return web.Response(text=SGLANG_TEXT)

        async def broken(_: web.Request) -> web.Response:
            return web.Response(status=500)

        async def garbage(_: web.Request) -> web.Response:
            return web.Response(text="this is { not prometheus\n")

        app = web.Application()
        for path, fn in (("/good", good), ("/slow", slow), ("/broken", broken), ("/garbage", garbage)):
            app.router.add_get(path, fn)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        s = Scraper(timeout_s=0.5)
        t0 = time.monotonic()
        try:
            got = await s.scrape([(n, f"http://127.0.0.1:{port}/{n}") for n in ("good", "slow", "broken", "garbage")]
                                 + [("closed", "http://127.0.0.1:1/metrics")])
            took = time.monotonic() - t0
        finally:
            await s.close()
            await runner.cleanup()
        return dict(got), took

    got, took = asyncio.run(main())
    assert set(got) == {"good"} and got["good"].values[Key.RUNNING] == 12
    assert took < 1.5  # the slow pod was cut at its 0.5 s deadline, the others in parallel


def test_a_deleted_deployment_is_forgotten() -> None:
    a = runner_mod.Autoscaler(object(), FakeState({}, []), lambda key: None, scraper=FakeScraper({}),  # type: ignore[arg-type]
                              writer=FakeWriter({}))  # type: ignore[arg-type]
    a._last[("ns", "x")] = {}
    a.forget("ns", "x")
    assert ("ns", "x") not in a._last

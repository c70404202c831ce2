"""Autoscaling both roles end to end: real runtimes on kwok pods (the harness's kubelet) with a declared
compute cost (``PDFLEET_COMPUTE_COST``: prefill per prompt token, decode per step and per running request,
a start-up delay), behind the deployment's router, under client traffic through the router's Service, with
the operator running the planner every 5 s:

- a load step up (1 -> 8 requests in flight) makes prefill grow on its backlog, then decode on its
  running requests, within the windows;
- a step down (8 -> 1) shrinks both back to their minimum through drains (none forced);
- throughout, read from watches: the GPUs of every pod alive (draining and terminating ones included)
  stay within the budget, and every desired pair the autoscaler wrote is inside the ratio band;
- client failures, router retries and failed transfers are 0; the events and ``status.autoscaling``
  say why each step happened.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from kubernetes import watch
from kubernetes.client import CoreV1Api, CustomObjectsApi

from pdfleet_devcluster import LocalCluster
from pdfleet_runtime.testing.chat import ChatTraffic
from tests.cluster.conftest import OperatorProcess
from tests.e2e.traffic import LOCAL_ARGS, NAME, RUNTIME_ARGS, Fleet, Traffic, manifest

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(1500)]

BUDGET = 6  # GPUs (tp 1: one per replica)
BAND = (0.5, 2.0)
COST = {"prefillSecondsPerPromptToken": 0.004,  # ~0.4 s for the mix's mean prompt (about 106 tokens)
        "decodeSecondsPerToken": 0.03, "decodeSecondsPerRunningRequest": 0.03,  # a step: 30 ms + 30 ms x batch
        "startupSeconds": 5}
AUTOSCALING = {
    "prefill": {"minReplicas": 1, "maxReplicas": 3, "scaleDownStabilizationSeconds": 20,
                "signals": {"backlog": {"targetSeconds": 1.0, "prefillTokensPerSecond": 1 / 0.004}}},
    "decode": {"minReplicas": 1, "maxReplicas": 3, "scaleDownStabilizationSeconds": 20,
               "signals": {"runningRequests": {"targetPerReplica": 2}}},
    "prefillDecodeRatio": {"min": BAND[0], "max": BAND[1]},
    "gpuBudget": BUDGET,
}


class Desired:
    """A watch of the PDDeployment: every (prefill, decode) desired pair the autoscaler wrote, with when."""

    def __init__(self, api: Any, ns: str) -> None:
        self.custom, self.ns = CustomObjectsApi(api), ns
        self.seen: list[tuple[float, int, int, str, str]] = []
        self.error: Exception | None = None
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            w = watch.Watch()
            for ev in w.stream(self.custom.list_namespaced_custom_object, "pdfleet.io", "v1alpha1", self.ns,
                               "pddeployments", timeout_seconds=1400):
                a = ((ev["object"].get("status") or {}).get("autoscaling") or {})
                p, d = a.get("prefill") or {}, a.get("decode") or {}
                if "desired" in p and "desired" in d:
                    pair = (p["desired"], d["desired"], p.get("reason", ""), d.get("reason", ""))
                    if not self.seen or self.seen[-1][1:] != pair:
                        self.seen.append((time.monotonic(), *pair))
                if self._stop.is_set():
                    w.stop()
        except Exception as exc:
            if not self._stop.is_set():
                self.error = exc

    def first(self, role: str, at_least: int) -> float | None:
        i = 1 if role == "prefill" else 2
        return next((s[0] for s in self.seen if s[i] >= at_least), None)

    def halt(self) -> None:
        self._stop.set()


@contextmanager
def autoscaled_fleet(cluster: LocalCluster, ns: str, workdir: Path) -> Iterator[Fleet]:
    """One prefill and one decode with ``spec.autoscaling`` and the declared cost, Available through their
    own gates and serving through the router."""
    api = cluster.api_client()

    def args(pod: dict) -> tuple[str, ...]:
        role = pod["metadata"]["labels"].get("pdfleet.io/role", "")
        return (*LOCAL_ARGS, *RUNTIME_ARGS.get(role, ())) if role else ()

    runner = cluster.kubelet(ns, workdir, selector="app.kubernetes.io/managed-by=pdfleet-operator", extra_args=args,
                             extra_env={"MC_LOG_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1",
                                        "PDFLEET_COMPUTE_COST": json.dumps(COST)})
    fleet = Fleet(cluster, ns, CoreV1Api(api), runner)
    runner.start()
    try:
        body = manifest(ns, prefill=1, decode=1)
        body["spec"]["autoscaling"] = AUTOSCALING
        # Room on one decode pod for every request in flight at the step and its canaries: a full pool is
        # refused (503, the router retries), where an engine would queue; the signals, not a refusal, scale.
        body["spec"]["decode"]["pool"]["maxConcurrentRequests"] = 16
        cluster.kubectl("apply", "-f", "-", input=json.dumps(body))
        fleet.wait(fleet.available, 240, "Available through real runtimes' gates")
        fleet.wait(fleet.router_ready, 120, "the router serving requests")
        yield fleet
    finally:
        for t in fleet._threads:
            t.halt()
        runner.shutdown()


def traffic_at(fleet: Fleet, concurrency: int) -> Traffic:
    t = Traffic(fleet)
    # Past the runtimes' own request timeout (60 s): a request stuck in a pod ends with the pod's reason.
    t.chat = ChatTraffic(fleet.router_url(), NAME, concurrency=concurrency, timeout_s=120)
    fleet._threads.append(t)
    return t.start()


def clean(fleet: Fleet, t: Traffic) -> None:
    """``assert_clean``, with the pods, the status and the runtimes' logs when it fails."""
    try:
        t.assert_clean()
    except AssertionError as e:
        wall = time.time() - time.monotonic()
        when = [f"request {a.i}: {time.strftime('%H:%M:%S', time.localtime(a.started + wall))} -> "
                f"{time.strftime('%H:%M:%S', time.localtime(a.ended + wall))}, status {a.status}"
                for a in t.chat.failures()]
        raise AssertionError(f"{e}\n{when}\n{fleet.diagnose()}") from None


def desired(fleet: Fleet) -> tuple[int, int]:
    a = fleet.status().get("autoscaling") or {}
    return (a.get("prefill") or {}).get("desired", 0), (a.get("decode") or {}).get("desired", 0)


def test_a_load_step_scales_prefill_then_decode_up_and_both_down_through_drains(
        cluster: LocalCluster, operator: OperatorProcess, namespace: str, tmp_path: Path) -> None:
    operator.restart("--autoscale-interval-seconds", "5")
    with autoscaled_fleet(cluster, namespace, tmp_path / "pods") as fleet:
        runner = fleet.runner
        pods0 = len(fleet.core.list_namespaced_pod(namespace).items)
        timeline = fleet.timeline(pods0)
        decisions = Desired(cluster.api_client(), namespace)
        try:
            # -- a step up: 8 requests in flight ---------------------------------------------------------
            high = traffic_at(fleet, 8)
            t_up = time.monotonic()
            fleet.wait(lambda: desired(fleet)[0] >= 2, 180, "prefill scaled up on its backlog")
            fleet.wait(lambda: desired(fleet)[1] >= 2, 240, "decode scaled up on its running requests")
            fleet.wait(lambda: len(runner.decode_pods()) >= 2 and fleet.available(), 240, "the added pods ready")
            high.wait_served(8, timeout=120)
            t_prefill, t_decode = decisions.first("prefill", 2), decisions.first("decode", 2)
            assert t_prefill is not None and t_decode is not None and t_prefill <= t_decode, decisions.seen
            print(f"prefill grew {t_prefill - t_up:.0f}s after the step, decode {t_decode - t_up:.0f}s; "
                  f"decisions {decisions.seen}", flush=True)
            high.stop()
            clean(fleet, high)
            peak = set(runner.decode_pods()) | set(runner.running("prefill"))

            # -- a step down: 1 request in flight ----------------------------------------------------------
            low = traffic_at(fleet, 1)
            fleet.wait(lambda: desired(fleet) == (1, 1), 360, "both roles back to their minimum")
            fleet.wait(lambda: len(runner.decode_pods()) == 1 and len(runner.running("prefill")) == 1
                       and fleet.available(), 240, "the surplus pods drained and gone")
            low.wait_served(3, timeout=60)
            low.stop()
            clean(fleet, low)
        finally:
            decisions.halt()
        timeline.stop()
        assert decisions.error is None, decisions.error

        # -- what held throughout ------------------------------------------------------------------------
        for _, snap in timeline.snapshots[timeline._first:]:
            gpus = sum(1 for s in snap.values() if s.role in ("prefill", "decode"))
            assert gpus <= BUDGET, snap
        for _, p, d, *_ in decisions.seen:
            assert BAND[0] * d <= p <= BAND[1] * d, decisions.seen
        removed = peak - set(runner.decode_pods()) - set(runner.running("prefill"))
        assert removed
        for pod in removed:
            _, finished = fleet.drain_log(pod)
            assert finished, f"{pod}'s drain did not finish unforced"
        assert fleet.forced_deletes() == []

        # -- why: events and status ----------------------------------------------------------------------
        reasons = {e.get("reason") for e in fleet.events()}
        assert "AutoscaleSignalAboveTarget" in reasons and "AutoscaleSignalBelowTarget" in reasons, reasons
        messages = [e["message"] for e in fleet.events() if e.get("reason", "").startswith("Autoscale")]
        assert any("scale down (through drains)" in m for m in messages), messages
        # The status is written by the decision pass (every 5 s here): the one after the last drain ended.
        fleet.wait(lambda: fleet.status()["autoscaling"]["gpus"] == 2, 60, "the status counting 1 + 1 GPUs")
        status = fleet.status()["autoscaling"]
        assert status["prefill"]["readings"][0]["signal"] == "backlogSeconds"
        assert status["decode"]["readings"][0]["signal"] == "runningRequestsPerReplica"
        assert status["gpus"] == 2 and status["ratioInBand"] is True


def test_a_role_driven_through_its_scale_subresource_follows_it_through_drains(
        cluster: LocalCluster, operator: OperatorProcess, namespace: str, tmp_path: Path) -> None:
    """What an HPA or KEDA does, through the scale API (the local apiserver has no metrics API for a real
    HPA): ``kubectl scale`` on the decode role's PDRoleScale, 2 -> 3 -> 1, under traffic."""
    from tests.e2e.traffic import running_fleet

    scale = f"{NAME}-decode"
    with running_fleet(cluster, namespace, tmp_path / "pods", prefill=1, decode=2) as fleet:
        runner = fleet.runner
        fleet.patch({"decode": {"scalingAdapter": True}})  # not a new revision: no rollout

        def scale_status() -> dict:
            out = cluster.kubectl("-n", namespace, "get", "pdrolescale", scale, "-o", "json", check=False)
            return (json.loads(out.stdout).get("status") or {}) if out.returncode == 0 else {}

        fleet.wait(lambda: scale_status().get("inEffect") is True and scale_status().get("replicas") == 2, 60,
                   "the operator made the decode role's PDRoleScale")
        raw = json.loads(cluster.kubectl("get", "--raw", f"/apis/pdfleet.io/v1alpha1/namespaces/{namespace}/"
                                         f"pdrolescales/{scale}/scale").stdout)
        assert raw["kind"] == "Scale" and raw["spec"]["replicas"] == 2 and raw["status"]["replicas"] == 2
        assert raw["status"]["selector"] == f"pdfleet.io/deployment={NAME},pdfleet.io/role=decode"
        before = set(runner.decode_pods())
        traffic = fleet.traffic()
        traffic.wait_served(4)
        cluster.kubectl("-n", namespace, "scale", "pdrolescale", scale, "--replicas=3")
        fleet.wait(lambda: len(runner.decode_pods()) == 3 and fleet.available(), 180, "3 decode pods")
        traffic.wait_served(4)
        cluster.kubectl("-n", namespace, "scale", "pdrolescale", scale, "--replicas=1")
        fleet.wait(lambda: len(runner.decode_pods()) == 1 and scale_status().get("replicas") == 1, 180,
                   "1 decode pod, drained")
        traffic.wait_served(4)
        traffic.stop()
        clean(fleet, traffic)
        gone = before - set(runner.decode_pods())
        assert gone and all(fleet.drain_log(p)[1] for p in gone), [fleet.drain_log(p) for p in gone]
        assert fleet.forced_deletes() == []
        assert fleet.pdd()["spec"]["decode"]["replicas"] == 2  # the spec's count is not what runs
        # Double control is refused by the apiserver itself (CEL), naming the rule.
        both = manifest(namespace, prefill=1, decode=2)
        both["spec"]["decode"]["scalingAdapter"] = True
        both["spec"]["autoscaling"] = AUTOSCALING
        out = cluster.kubectl("apply", "-f", "-", input=json.dumps(both), check=False)
        assert out.returncode != 0 and "autoscaling-double-control" in out.stderr, out.stderr

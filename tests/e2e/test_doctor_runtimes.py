"""`pdfleet doctor` against a fleet of real runtime pods in the local cluster (issue 46): it reads the
deployment and its pods through the apiserver, and each pod's /metrics through the apiserver's pod proxy, as
it would in any cluster.

- the healthy fleet, with chat traffic through the router: every check passes (exit 0), the counters judged
  over a window in which requests were served;
- the router pod's sweeper stopped (SIGSTOP) and a decode scaled away (drained, then deleted): sglang-router keeps
  its worker, and the doctor fails ``router-workers`` naming the worker's address (exit 1); the sweeper resumed, the
  worker is removed and the check passes;
- the prefill's processes killed (a crash on the data path, not on what the doctor reads): the decodes' canaries
  fail, and the doctor fails naming the check (``transfer-path``), the pod and the reason (exit 1); the
  PDDeployment turns ``Degraded`` (``TransferPathBroken``) naming the decode and the reason, with a warning event.

The fleet runs its canaries every 2 s (``spec.transfer.canaryPeriodSeconds``): the decodes' canary counters show it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdfleet_devcluster import LocalCluster, procs
from pdfleet_runtime.testing.scrape import scrape
from tests.cluster.conftest import OperatorProcess
from tests.e2e.traffic import NAME, Fleet, running_fleet

pytestmark = pytest.mark.cluster


def _doctor(cluster: LocalCluster, namespace: str, *args: str) -> tuple[int, dict]:
    out = subprocess.run([sys.executable, "-m", "pdfleet_operator.cli", "doctor", NAME, "-n", namespace,
                          "-o", "json", *args], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig)})
    assert out.stdout, out.stderr
    return out.returncode, json.loads(out.stdout)


def _sweeper(fleet: Fleet) -> int:
    """The router pod's sweeper of stale workers: the launcher's forked child."""
    [router] = [p for p in fleet.runner.pods.values() if p.name.startswith(f"{NAME}-router-") and p.started]
    assert router.containers
    ps, todo = [], [c.proc.pid for c in router.containers]  # the containers' processes and all below them
    while todo:
        kids = procs.children(todo.pop())
        ps += kids
        todo += [k.pid for k in kids]
    # The launcher runs sglang-router in its own process, which renames itself (``sglang::router``); the sweeper it
    # forked keeps the launcher's command line.
    leaders = {c.proc.pid for c in router.containers}
    sweepers = [p.pid for p in ps if "router-launch" in p.cmd and p.ppid in leaders]
    assert len(sweepers) == 1, [str(p) for p in ps]
    return sweepers[0]


def _canaries(url: str) -> float:
    """The decode's canaries so far, passed or failed (its /metrics)."""
    m = scrape(url + "/metrics")
    return sum(v for k, v in m.items() if k.startswith("pdfleet_transfers_total{") and 'kind="canary"' in k)


def test_the_doctor_passes_a_healthy_fleet_and_names_a_crashed_prefill(
        cluster: LocalCluster, operator: OperatorProcess, namespace: str, tmp_path: Path) -> None:
    with running_fleet(cluster, namespace, tmp_path / "pods", canary_period=2) as fleet:
        decode_pods = [p for p in fleet.runner.running("decode").values()]
        before = [_canaries(p.url) for p in decode_pods]
        time.sleep(12.0)
        # every 2 s (10 s without the field: 2 at most in 12 s): at least 3 each in 12 s, even on a loaded host
        ran = [_canaries(p.url) - b for p, b in zip(decode_pods, before, strict=True)]
        print("canaries in 12 s per decode:", ran)
        assert min(ran) >= 3, ran
        traffic = fleet.traffic()
        traffic.wait_served(4)
        rc, report = _doctor(cluster, namespace, "--window", "3")
        checks = report["checks"]
        print("doctor, healthy:", [(c["check"], c["subject"], c["verdict"]) for c in checks])
        assert rc == 0 and report["failed"] == 0, json.dumps(checks, indent=1)[:4000]
        pods = {p.metadata.name for p in fleet.core.list_namespaced_pod(namespace).items
                if (p.metadata.labels or {}).get("pdfleet.io/role") in ("prefill", "decode")}
        # Every pod's metrics were read through the proxy and judged: no pod left at "cannot-check".
        for check in ("transfer-path", "transfer-failures", "state-integrity", "link"):
            assert {c["subject"] for c in checks if c["check"] == check and c["verdict"] == "ok"} == pods, \
                [c for c in checks if c["check"] in (check, "metrics")]
        # the versions the pods run went through the capability matrix (the stored spec with them in place)
        assert [c["verdict"] for c in checks if c["check"] == "matrix"] == ["ok"], \
            [c for c in checks if c["check"] == "matrix"]
        # every decode answered only requests whose state it received (none recomputed)
        received = [c for c in checks if c["check"] == "state-received"]
        assert {c["subject"] for c in received if c["verdict"] == "ok"} == {
            p for p in pods if "-decode-" in p}, received
        assert [c["verdict"] for c in checks if c["check"] == "router-workers"] == ["ok"], \
            [c for c in checks if c["check"] == "router-workers"]
        traffic.stop()
        traffic.assert_clean()

        # -- a router worker left for a deleted pod: the router pod's sweeper stopped, a decode drained away ----
        # sglang-router's discovery never removes a pod that went not-Ready before its deletion (a drained one):
        # the sweeper does, and stopped (SIGSTOP) it cannot.
        sweeper = _sweeper(fleet)
        os.kill(sweeper, signal.SIGSTOP)
        try:
            before = dict(fleet.runner.decode_pods())
            fleet.patch({"decode": {"replicas": 1}})
            fleet.wait(lambda: len(fleet.live_pods()) == 1 and len(fleet.runner.decode_pods()) == 1, 180,
                       "scaled in to 1 decode")
            [gone] = set(before) - set(fleet.runner.decode_pods())
            rc, report = _doctor(cluster, namespace)
            [workers] = [c for c in report["checks"] if c["check"] == "router-workers"]
            print("doctor, sweeper stopped, a decode drained away:", workers)
            assert rc == 1 and workers["verdict"] == "fail" and f"http://{before[gone].ip}:" in workers["detail"] \
                and workers["fix"], workers
        finally:
            os.kill(sweeper, signal.SIGCONT)
        time.sleep(3.0)  # the sweeper's next rounds (every second)
        rc, report = _doctor(cluster, namespace)
        [workers] = [c for c in report["checks"] if c["check"] == "router-workers"]
        assert workers["verdict"] == "ok", workers  # swept once the sweeper ran again

        [prefill] = fleet.runner.running("prefill").values()
        prefill.signal(signal.SIGKILL)
        decodes = set(fleet.runner.decode_pods())

        def decode_gate_failed() -> bool:
            return any(c.type == "pdfleet.io/transfer-path" and c.status == "False"
                       for p in fleet.core.list_namespaced_pod(namespace).items if p.metadata.name in decodes
                       for c in p.status.conditions or ())

        fleet.wait(decode_gate_failed, 90, "a decode's canary failing against the killed prefill")

        def degraded() -> dict | None:
            cond = fleet.conditions().get("Degraded") or {}
            named = all(f"decode pod {d}: PeerUnreachable" in (cond.get("message") or "") for d in decodes)
            return cond if cond.get("status") == "True" and named else None

        cond = fleet.wait(degraded, 90, "Degraded naming the decode (its pod ran 30 s)")
        print("Degraded:", cond["reason"], cond["message"][:400])
        assert cond["reason"] == "TransferPathBroken", cond
        warned = [e for e in fleet.events() if e.get("reason") == "TransferPathBroken" and e.get("type") == "Warning"]
        assert warned and "decode pod" in warned[0]["message"], [e.get("reason") for e in fleet.events()]
        rc, report = _doctor(cluster, namespace)
        bad = [(c["check"], c["subject"], c["detail"]) for c in report["checks"] if c["verdict"] == "fail"]
        print("doctor, prefill killed:", bad)
        assert rc == 1 and report["failed"] == len(bad) > 0
        assert any(check == "transfer-path" and subject in decodes for check, subject, _ in bad), bad
        assert all(c["fix"] for c in report["checks"] if c["verdict"] == "fail")

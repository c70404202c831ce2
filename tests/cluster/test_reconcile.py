"""Reconcile on the real control plane: a PDDeployment becomes owned children and gated pods on
kwok GPU nodes, goes Available only through the transfer-path gate, heals drift, scales through
the scale subresource, survives an operator restart without duplicates, and cascades on delete.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdfleet_devcluster import LocalCluster
from pdfleet_runtime.config import READINESS_GATE, drained_message
from tests.cluster.conftest import OperatorProcess
from tests.helpers import delete_namespace_and_pods, wait_until

pytestmark = pytest.mark.cluster

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "valid" / "llama-dense.yaml"
CHILD_KINDS = ("configmaps", "services", "secrets", "serviceaccounts", "roles", "rolebindings",
               "networkpolicies", "poddisruptionbudgets", "controllerrevisions", "pods")


def _json(cluster: LocalCluster, ns: str, *args: str) -> dict:
    return json.loads(cluster.kubectl("-n", ns, "get", *args, "-o", "json").stdout)


def _pods(cluster: LocalCluster, ns: str, role: str | None = None) -> list[dict]:
    sel = "pdfleet.io/deployment=llama-dense" + (f",pdfleet.io/role={role}" if role else "")
    return [p for p in _json(cluster, ns, "pods", "-l", sel)["items"] if "deletionTimestamp" not in p["metadata"]]


def _condition(obj: dict, kind: str) -> dict:
    return next((c for c in (obj.get("status") or {}).get("conditions") or () if c["type"] == kind), {})


def _set_gates(cluster: LocalCluster, ns: str, status: str) -> None:
    for pod in _pods(cluster, ns):
        patch = {"status": {"conditions": [{"type": READINESS_GATE, "status": status}]}}
        cluster.kubectl("-n", ns, "patch", "pod", pod["metadata"]["name"], "--subresource=status",
                        "--type=strategic", "-p", json.dumps(patch))


@pytest.fixture(scope="module")
def fleet(cluster: LocalCluster, operator: OperatorProcess) -> Iterator[str]:
    ns = "reconcile"
    cluster.kubectl("create", "namespace", ns)
    wait_until(lambda: cluster.kubectl("-n", ns, "get", "sa", "default", check=False).returncode == 0,
               what="default ServiceAccount")
    cluster.kubectl("-n", ns, "apply", "-f", str(EXAMPLE))
    yield ns
    delete_namespace_and_pods(cluster, ns)


def test_pods_created_but_not_available_until_gate(cluster: LocalCluster, fleet: str) -> None:
    ns = fleet
    wait_until(lambda: len(_pods(cluster, ns, "prefill")) == 1 and len(_pods(cluster, ns, "decode")) == 2,
               what="1 prefill and 2 decode pods", timeout=60)
    wait_until(lambda: all(p["status"].get("phase") == "Running" for p in _pods(cluster, ns)),
               what="pods Running on kwok nodes")
    for pod in _pods(cluster, ns):
        gpus = pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
        assert gpus == ("4" if pod["metadata"]["labels"]["pdfleet.io/role"] == "prefill" else "2")
        assert pod["spec"]["nodeName"].startswith("kwok-gpu-")
        assert _condition(pod, "Ready")["status"] == "False"
    pdd = wait_until(lambda: (o := _json(cluster, ns, "pdd", "llama-dense")) and
                     _condition(o, "Available") and o, what="Available condition written")
    assert _condition(pdd, "Available")["status"] == "False"
    assert _condition(pdd, "Admitted")["status"] == "True"
    assert pdd["status"]["decodeReady"] == "0/2"
    assert pdd["status"]["observedGeneration"] == pdd["metadata"]["generation"]

    _set_gates(cluster, ns, "False")
    pdd = _json(cluster, ns, "pdd", "llama-dense")
    assert _condition(pdd, "Available")["status"] == "False"

    _set_gates(cluster, ns, "True")
    pdd = wait_until(lambda: (o := _json(cluster, ns, "pdd", "llama-dense")) and
                     _condition(o, "Available").get("status") == "True" and o,
                     what="Available after the transfer-path gates turned True", timeout=60)
    assert pdd["status"]["prefillReady"] == "1/1" and pdd["status"]["decodeReady"] == "2/2"
    table = cluster.kubectl("-n", ns, "get", "pdd", "llama-dense").stdout
    assert "P tp4xpp1 / D tp2xpp1" in table and "2/2" in table
    events = cluster.kubectl("-n", ns, "get", "events", "--field-selector",
                             "involvedObject.name=llama-dense", "-o", "json").stdout
    reasons = {e["reason"] for e in json.loads(events)["items"]}
    assert "Created" in reasons


def test_every_child_is_owned(cluster: LocalCluster, fleet: str) -> None:
    ns = fleet
    uid = _json(cluster, ns, "pdd", "llama-dense")["metadata"]["uid"]
    seen = 0
    for kind in CHILD_KINDS:
        for obj in _json(cluster, ns, kind, "-l", "pdfleet.io/deployment=llama-dense")["items"]:
            refs = obj["metadata"].get("ownerReferences") or []
            assert [r["uid"] for r in refs] == [uid], f"{kind}/{obj['metadata']['name']}"
            seen += 1
    assert seen >= 14  # 2 configmaps, 2 services, secret, sa, role, binding, policy, 2 pdbs, 3 pods


def test_drift_is_undone(cluster: LocalCluster, fleet: str) -> None:
    ns = fleet
    cluster.kubectl("-n", ns, "delete", "service", "llama-dense-decode")
    wait_until(lambda: cluster.kubectl("-n", ns, "get", "service", "llama-dense-decode", check=False).returncode == 0,
               what="deleted Service restored", timeout=30)
    config = _json(cluster, ns, "configmaps", "-l", "pdfleet.io/role=decode")["items"][0]["metadata"]["name"]
    cluster.kubectl("-n", ns, "patch", "configmap", config, "--type=merge",
                    "-p", json.dumps({"data": {"runtime.yaml": "tampered: true\n"}}))
    wait_until(lambda: "tampered" not in _json(cluster, ns, "configmap", config)["data"]["runtime.yaml"],
               what="edited ConfigMap restored", timeout=30)
    victim = _pods(cluster, ns, "decode")[0]["metadata"]["name"]
    cluster.kubectl("-n", ns, "delete", "pod", victim, "--wait=true", timeout=60)
    wait_until(lambda: len(_pods(cluster, ns, "decode")) == 2, what="deleted pod replaced", timeout=30)
    _set_gates(cluster, ns, "True")


def test_scale_subresource_scales_decode(cluster: LocalCluster, fleet: str) -> None:
    ns = fleet
    cluster.kubectl("-n", ns, "scale", "pdd/llama-dense", "--replicas=3")
    wait_until(lambda: len(_pods(cluster, ns, "decode")) == 3, what="3 decode pods", timeout=30)
    cluster.kubectl("-n", ns, "scale", "pdd/llama-dense", "--replicas=1")
    # Scale-down drains first: the surplus pods turn unroutable and wait for the runtime to report
    # drained; here the test reports it in the runtime's place.
    # The operator patches the surplus pods one after the other: wait for both.
    def unroutable() -> list[dict] | None:
        pods = [p for p in _pods(cluster, ns, "decode") if p["metadata"]["labels"].get("pdfleet.io/routable") == "false"]
        return pods if len(pods) == 2 else None

    draining = wait_until(unroutable, what="both surplus decode pods draining", timeout=30)
    assert all("pdfleet.io/drain-started" in p["metadata"]["annotations"] for p in draining)
    assert len(_pods(cluster, ns, "decode")) == 3  # nothing deleted before it is drained
    for pod in draining:  # stamped with the drain it reports, as the runtime does
        message = drained_message(pod["metadata"]["annotations"]["pdfleet.io/drain-started"], "no transfer in flight")
        patch = {"status": {"conditions": [{"type": "pdfleet.io/drained", "status": "True", "message": message}]}}
        cluster.kubectl("-n", ns, "patch", "pod", pod["metadata"]["name"], "--subresource=status",
                        "--type=strategic", "-p", json.dumps(patch))
    wait_until(lambda: len(_pods(cluster, ns, "decode")) == 1, what="1 decode pod", timeout=30)
    scale = json.loads(cluster.kubectl("-n", ns, "get", "--raw",
                                       f"/apis/pdfleet.io/v1alpha1/namespaces/{ns}/pddeployments/llama-dense/scale").stdout)
    assert scale["spec"]["replicas"] == 1
    wait_until(lambda: json.loads(cluster.kubectl(
        "-n", ns, "get", "--raw", f"/apis/pdfleet.io/v1alpha1/namespaces/{ns}/pddeployments/llama-dense/scale"
    ).stdout)["status"].get("replicas") == 1, what="scale status", timeout=30)


def test_operator_restart_creates_no_duplicates(cluster: LocalCluster, fleet: str, operator: OperatorProcess) -> None:
    ns = fleet
    before = sorted(p["metadata"]["name"] for p in _pods(cluster, ns))
    children = {k: len(_json(cluster, ns, k, "-l", "pdfleet.io/deployment=llama-dense")["items"]) for k in CHILD_KINDS}
    operator.restart()
    # Let it run a few passes (resync and the resume handler) before comparing.
    wait_until(lambda: "reconcile-resume" in operator.log_text(), what="resume handler ran", timeout=30)
    import time

    time.sleep(3)
    after = sorted(p["metadata"]["name"] for p in _pods(cluster, ns))
    assert after == before
    assert {k: len(_json(cluster, ns, k, "-l", "pdfleet.io/deployment=llama-dense")["items"]) for k in CHILD_KINDS} == children


def test_delete_cascades(cluster: LocalCluster, fleet: str) -> None:
    ns = fleet
    cluster.kubectl("-n", ns, "delete", "pdd", "llama-dense", "--wait=true", timeout=60)

    def all_gone() -> bool:
        return all(not _json(cluster, ns, k, "-l", "pdfleet.io/deployment=llama-dense")["items"] for k in CHILD_KINDS)

    wait_until(all_gone, what="every child garbage-collected", timeout=60)



def test_operator_metrics_move_with_reconciles(operator: OperatorProcess, fleet: str) -> None:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{operator.metrics_port}/metrics", timeout=5) as resp:
        families = {f.name: f for f in text_string_to_metric_families(resp.read().decode())}
    passes = {s.labels["result"]: s.value for s in families["pdfleet_operator_reconcile_passes"].samples
              if s.name.endswith("_total")}
    assert passes.get("ok", 0) >= 1
    assert families["pdfleet_operator_reconcile_seconds"].samples

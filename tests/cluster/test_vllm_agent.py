"""A vLLM PDDeployment on the real control plane, its ``engine`` containers run by the STAND-IN for vLLM
(``devcluster.standin.VllmStandIn``: ``pdfleet-runtime serve`` built from the rendered ``vllm serve`` command,
speaking vLLM's PD contract; vLLM needs GPUs), the agent beside each engine as rendered, and vllm-router 0.1.17
run from its rendered command in front (issue 44: the agent beside vLLM).

The deployment reaches Available only through the agents (no other gate writer runs here): each decode pod's gate
carries its agent's canary, sent over NIXL's two steps as vllm-router sends a request, and a prefill's gate says
its engine agreed with the deployment (vLLM's ``/version`` and ``/v1/models``). A decode-only engine upgrade then
rolls with zero failed client requests through vllm-router, each old decode pod draining through its agent on
vLLM's gauges; `pdfleet doctor` reads the decode's state-received from vLLM's own names on the way. Then a decode
whose engine recomputes every prompt is rolled in: its agent's canary finds no state moved and never lets it turn
ready, while the serving decode keeps answering.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdfleet_devcluster import LocalCluster
from pdfleet_devcluster.kubelet import Kubelet, wait
from pdfleet_devcluster.standin import VllmStandIn
from pdfleet_operator.resources.names import router_name
from pdfleet_runtime.config import READINESS_GATE
from tests.cluster.conftest import OperatorProcess
from tests.cluster.test_sglang_agent import Client, doctor

pytestmark = pytest.mark.cluster

NAME = "vllm"
MODEL = "llama-test"
STAND_IN = VllmStandIn(agent_args=("--canary-period", "3", "--retry-period", "0.5", "--check-period", "1"),
                       serve_args=("--fault-write-delay", "0.2", "--canary-period", "3600", "--retry-period", "3600"))


def manifest(ns: str) -> dict:
    pool = {"maxConcurrentRequests": 8, "kvTokensPerReplica": 2048}
    return {
        "apiVersion": "pdfleet.io/v1alpha1", "kind": "PDDeployment", "metadata": {"name": NAME, "namespace": ns},
        "spec": {
            "engine": {"kind": "vllm", "version": "0.33.0", "image": "vllm/vllm-openai:v0.33.0"},
            "model": {"layout": {"preset": "llama-dense"}, "servedName": MODEL,
                      "source": {"path": "/models/llama", "volume": {"emptyDir": {}}}},
            "transfer": {"backend": "nixl", "protocol": "tcp"},
            "router": {"image": "host", "decodePolicy": "round_robin"},
            "prefill": {"replicas": 1, "parallelism": {"tensor": 1}, "image": "host",
                        "pool": {**pool, "maxConcurrentRequests": 16}},
            "decode": {"replicas": 1, "parallelism": {"tensor": 1}, "image": "host", "pool": pool},
            "rollout": {"maxSurge": 1, "maxUnavailable": 0, "drainTimeoutSeconds": 60,
                        "progressDeadlineSeconds": 300},
        },
    }


@pytest.fixture
def kubelet(cluster: LocalCluster, namespace: str, tmp_path: Path) -> Iterator[Kubelet]:
    k = cluster.kubelet(namespace, tmp_path / "pods", selector="app.kubernetes.io/managed-by=pdfleet-operator",
                        rewrite=STAND_IN, extra_env={"PYTHONUNBUFFERED": "1", "UCX_TLS": "tcp"})
    k.start()
    try:
        yield k
    finally:
        k.shutdown(grace_s=10)


def test_vllm_fleet_is_gated_by_its_agents_and_rolls_decode_with_zero_failed_requests(
        cluster: LocalCluster, operator: OperatorProcess, namespace: str, kubelet: Kubelet) -> None:
    def get(*args: str) -> dict:
        return json.loads(cluster.kubectl("-n", namespace, "get", *args, "-o", "json").stdout)

    def available() -> bool:
        st = get("pdd", NAME).get("status") or {}
        conds = {c["type"]: c["status"] for c in st.get("conditions") or ()}
        return conds.get("Available") == "True" and (st.get("rollout") or {}).get("phase") == "Complete"

    def diagnose() -> str:
        logs = "\n".join(f"--- {n}\n{t[-1500:]}" for n, t in kubelet.all_logs().items())
        return f"{cluster.kubectl('-n', namespace, 'get', 'pods', '-o', 'wide').stdout}\n{kubelet.errors[-3:]}\n{logs}"

    def decode_pods() -> dict[str, dict]:
        items = get("pods", "-l", "pdfleet.io/role=decode")["items"]
        return {p["metadata"]["name"]: p for p in items if not p["metadata"].get("deletionTimestamp")}

    cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest(namespace)))
    try:
        wait(available, 240, "Available through the agents' gates")
    except AssertionError as e:
        raise AssertionError(f"{e}\n{diagnose()}") from None
    pods = get("pods", "-l", "pdfleet.io/deployment=" + NAME)["items"]
    for p in pods:
        name = p["metadata"]["name"]
        agent = next(c for c in p["spec"]["containers"] if c["name"] == "runtime")["command"]
        assert agent[agent.index("--engine-kind") + 1] == "vllm", agent
        gate = {c["type"]: c for c in p["status"]["conditions"]}[READINESS_GATE]
        want = "TransferPathVerified" if "-decode-" in name else "EngineVerified"
        assert gate["status"] == "True" and gate["reason"] == want, (name, gate)
        if "-decode-" in name:
            assert "canary as vllm-router sends it: NIXL request" in gate["message"], gate
    pod = kubelet.sandbox_of(next(iter(decode_pods())))
    version = json.loads(pod.exec("curl", "-sS", "http://127.0.0.1:30000/version").stdout)
    assert version == {"version": "0.33.0"}, version

    router = wait(lambda: next((p for p in list(kubelet.pods.values())
                                if p.name.startswith(router_name(NAME) + "-") and p.started), None), 60, "router pod")
    commands = [c["command"] for p in get("pods")["items"] if p["metadata"]["name"] == router.name
                for c in p["spec"]["containers"]]
    assert any(cmd[0] == "vllm-router" for cmd in commands), commands
    client = Client(f"http://{router.ip}:30000")  # its requests name MODEL, this deployment's served name
    try:
        wait(lambda: client.one(0)[0] == 200, 120, "vllm-router serving a first request")
    except AssertionError as e:
        raise AssertionError(f"{e}: {client.one(0)}\n{diagnose()}") from None
    old = set(decode_pods())
    client.start()
    try:
        wait(lambda: client.ok() >= 5, 60, "traffic through the router")
        report = doctor(cluster, namespace, NAME, "--window", "4")
        print("doctor, vLLM stand-ins:", [(c["check"], c["subject"], c["verdict"]) for c in report["checks"]])
        [received] = [c for c in report["checks"] if c["check"] == "state-received"]
        assert received["verdict"] == "ok" and received["detail"].endswith("(vLLM (NIXL))"), received
        cluster.kubectl("-n", namespace, "patch", "pdd", NAME, "--type=merge", "-p", json.dumps(
            {"spec": {"decode": {"engine": {"image": "vllm/vllm-openai:v0.33.0-cu13"}}}}))
        try:
            wait(lambda: not (old & set(decode_pods())) and len(decode_pods()) == 1 and available(), 300,
                 "the decode engine upgrade rolled")
        except AssertionError as e:
            raise AssertionError(f"{e}\n{diagnose()}") from None
        done = time.monotonic()
        wait(lambda: client.ok(since=done) >= 5, 90, "traffic on the upgraded decode pod")
        # A decode whose engine recomputes every prompt (the stand-in's PDFLEET_KV_CONNECTOR=none, as a vLLM started
        # without its KV connector): its agent's canary finds no state moved, so it never turns ready and the
        # rollout holds while the serving decode keeps answering.
        upgraded = set(decode_pods())
        cluster.kubectl("-n", namespace, "patch", "pdd", NAME, "--type=merge", "-p", json.dumps(
            {"spec": {"decode": {"engine": {"env": [{"name": "PDFLEET_KV_CONNECTOR", "value": "none"}]}}}}))

        def refused() -> dict | None:
            for name, p in decode_pods().items():
                gate = {c["type"]: c for c in (p.get("status") or {}).get("conditions") or ()}.get(READINESS_GATE)
                if name not in upgraded and gate and gate["status"] == "False" and gate["reason"] == "CanaryFailed":
                    return gate
            return None
        try:
            gate = wait(refused, 120, "the recomputing decode refused by its agent's canary")
        except AssertionError as e:
            raise AssertionError(f"{e}\n{diagnose()}") from None
        assert "NIXL request" in gate["message"] and "the stand-in moved 0 of" in gate["message"], gate
        fault = time.monotonic()
        wait(lambda: client.ok(since=fault) >= 5, 60, "traffic on the serving decode while the new one is refused")
        assert upgraded <= set(decode_pods()), "the serving decode went before its replacement was ready"
    finally:
        client.stop_event.set()
        client.join(90)
    failures = client.failures()
    assert not failures, f"{len(failures)} of {len(client.results)} requests failed: {failures[:5]}"
    print(f"{len(client.results)} requests through vllm-router during the decode upgrade and the refused decode, "
          "0 failed")
    for name in old:  # each old decode pod drained through its agent before it went
        log = kubelet.sandbox_of(name).containers[1].log_path.read_text()
        assert "drain started (pod deleted)" in log and "drain finished" in log, log[-2000:]

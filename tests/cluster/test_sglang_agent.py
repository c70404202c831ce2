"""An SGLang PDDeployment on the real control plane, its ``engine`` containers run by the STAND-IN for
SGLang (``devcluster.standin.SGLangStandIn``: ``pdfleet-runtime serve`` built from the rendered
``sglang.launch_server`` command; SGLang needs GPUs), the agent beside each engine unchanged, and
sglang-router 0.3.2 run from its rendered command in front.

Covers issue 24's acceptance: the deployment reaches Available only through the agents (no other gate
writer runs here; each decode pod's gate carries the agent's canary verdict), the engine gets no API
token, and a decode-only engine upgrade rolls with zero failed client requests through the router.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdfleet_devcluster import LocalCluster
from pdfleet_devcluster.kubelet import Kubelet, wait
from pdfleet_devcluster.standin import SGLangStandIn
from pdfleet_operator.resources.names import router_name
from pdfleet_runtime.config import READINESS_GATE
from tests.cluster.conftest import OperatorProcess

pytestmark = pytest.mark.cluster

NAME = "sgl"
MODEL = "llama-test"
# Every transfer takes a while (so drains find requests in flight); the canary re-runs quickly here.
STAND_IN = SGLangStandIn(agent_args=("--canary-period", "3", "--retry-period", "0.5", "--check-period", "1"),
                         serve_args=("--fault-write-delay", "0.2", "--canary-period", "3600",
                                     "--retry-period", "3600"))


def manifest(ns: str, decode_engine: dict | None = None) -> dict:
    pool = {"maxConcurrentRequests": 8, "kvTokensPerReplica": 2048}
    decode: dict[str, Any] = {"replicas": 1, "parallelism": {"tensor": 1}, "image": "host", "pool": pool}
    if decode_engine:
        decode["engine"] = decode_engine
    return {
        "apiVersion": "pdfleet.io/v1alpha1", "kind": "PDDeployment", "metadata": {"name": NAME, "namespace": ns},
        "spec": {
            "engine": {"kind": "sglang", "version": "0.5.23", "image": "lmsysorg/sglang:v0.5.23"},
            "model": {"layout": {"preset": "llama-dense"}, "servedName": MODEL,
                      "source": {"path": "/models/llama", "volume": {"emptyDir": {}}}},
            "transfer": {"backend": "mooncake", "protocol": "tcp"},
            "router": {"image": "host", "decodePolicy": "round_robin"},
            "prefill": {"replicas": 1, "parallelism": {"tensor": 1}, "image": "host",
                        "pool": {**pool, "maxConcurrentRequests": 16}},
            "decode": decode,
            "rollout": {"maxSurge": 1, "maxUnavailable": 0, "drainTimeoutSeconds": 60,
                        "progressDeadlineSeconds": 300},
        },
    }


@pytest.fixture
def kubelet(cluster: LocalCluster, namespace: str, tmp_path: Path) -> Iterator[Kubelet]:
    k = cluster.kubelet(namespace, tmp_path / "pods", selector="app.kubernetes.io/managed-by=pdfleet-operator",
                        rewrite=STAND_IN, extra_env={"MC_LOG_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1"})
    k.start()
    try:
        yield k
    finally:
        k.shutdown(grace_s=10)


class Client(threading.Thread):
    """Chat completions through the router, back to back, until stopped; every answer recorded."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.stop_event, self.results = url, threading.Event(), []  # (t, status, body)

    def one(self, i: int) -> tuple[int, Any]:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"request {i}"}], "max_tokens": 8}
        req = urllib.request.Request(f"{self.url}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")[:500]
        except OSError as e:
            return 0, repr(e)

    def run(self) -> None:
        i = 0
        while not self.stop_event.is_set():
            i += 1
            code, body = self.one(i)
            self.results.append((time.monotonic(), code, body))
            time.sleep(0.05)

    def ok(self, since: float = 0.0) -> int:
        return sum(1 for t, c, b in list(self.results) if t >= since and c == 200 and _content(b))

    def failures(self) -> list[tuple[float, int, Any]]:
        return [r for r in list(self.results) if r[1] != 200 or not _content(r[2])]


def doctor(cluster: LocalCluster, namespace: str, name: str, *args: str) -> dict:
    """``pdfleet doctor NAME -o json`` against the cluster: its report (the engine path of its checks runs on an
    engine fleet: the deployment's engine kind says which names it reads)."""
    out = subprocess.run([sys.executable, "-m", "pdfleet_operator.cli", "doctor", name, "-n", namespace, "-o", "json",
                          *args], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig)})
    assert out.stdout, out.stderr
    return json.loads(out.stdout)


def _content(body: Any) -> str:
    try:
        return str(body["choices"][0]["message"]["content"])
    except (KeyError, IndexError, TypeError):
        return ""


def test_sglang_fleet_is_gated_by_its_agents_and_rolls_decode_with_zero_failed_requests(
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
        wait(available, 180, "Available through the agents' gates")
    except AssertionError as e:
        raise AssertionError(f"{e}\n{diagnose()}") from None
    gates = {p["metadata"]["name"]: {c["type"]: c for c in p["status"]["conditions"]}[READINESS_GATE]
             for p in get("pods", "-l", "pdfleet.io/deployment=" + NAME)["items"]}
    for name, gate in gates.items():
        want = "TransferPathVerified" if "-decode-" in name else "EngineVerified"
        assert gate["status"] == "True" and gate["reason"] == want, (name, gate)
        if "-decode-" in name:
            assert "canary as SGLang's router sends it: room" in gate["message"], gate
    # The engine (the stand-in here) gets no API credential; the agent beside it has the pod's token.
    pod = kubelet.sandbox_of(next(iter(decode_pods())))
    token = "/var/run/secrets/kubernetes.io/serviceaccount/token"
    assert pod.exec("test", "-e", token, container=0).returncode != 0
    assert pod.exec("test", "-s", token, container=1).returncode == 0
    info = json.loads(pod.exec("curl", "-sS", "http://127.0.0.1:30000/server_info").stdout)
    assert info["version"] == "0.5.23" and "standing in for sglang 0.5.23" in info["stand_in"]

    router = wait(lambda: next((p for p in list(kubelet.pods.values())
                                if p.name.startswith(router_name(NAME) + "-") and p.started), None), 60, "router pod")
    client = Client(f"http://{router.ip}:30000")
    try:
        wait(lambda: client.one(0)[0] == 200, 90, "the router serving a first request")
    except AssertionError as e:
        raise AssertionError(f"{e}: {client.one(0)}\n{diagnose()}") from None
    old = set(decode_pods())
    client.start()
    try:
        wait(lambda: client.ok() >= 5, 60, "traffic through the router")
        report = doctor(cluster, namespace, NAME, "--window", "4")
        print("doctor, SGLang stand-ins:", [(c["check"], c["subject"], c["verdict"]) for c in report["checks"]])
        [received] = [c for c in report["checks"] if c["check"] == "state-received"]
        assert received["verdict"] == "ok" and received["detail"].endswith("(SGLang)"), received
        cluster.kubectl("-n", namespace, "patch", "pdd", NAME, "--type=merge", "-p", json.dumps(
            {"spec": {"decode": {"engine": {"image": "lmsysorg/sglang:v0.5.23-cu13"}}}}))
        try:
            wait(lambda: not (old & set(decode_pods())) and len(decode_pods()) == 1 and available(), 300,
                 "the decode engine upgrade rolled")
        except AssertionError as e:
            raise AssertionError(f"{e}\n{diagnose()}") from None
        done = time.monotonic()
        wait(lambda: client.ok(since=done) >= 5, 60, "traffic on the upgraded decode pods")
    finally:
        client.stop_event.set()
        client.join(90)
    images = {c["image"] for p in decode_pods().values() for c in p["spec"]["containers"] if c["name"] == "engine"}
    assert images == {"lmsysorg/sglang:v0.5.23-cu13"}
    prefill = get("pods", "-l", "pdfleet.io/role=prefill")["items"]
    assert len(prefill) == 1 and prefill[0]["spec"]["containers"][0]["image"] == "lmsysorg/sglang:v0.5.23"
    failures = client.failures()
    assert not failures, f"{len(failures)} of {len(client.results)} requests failed: {failures[:5]}"
    print(f"{len(client.results)} requests through the router during the decode upgrade, 0 failed")
    for name in old:  # each old decode pod drained through its agent before it went
        log = kubelet.sandbox_of(name).containers[1].log_path.read_text()
        assert "drain started (pod deleted)" in log and "drain finished" in log, log[-2000:]

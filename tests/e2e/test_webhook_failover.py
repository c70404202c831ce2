"""A webhook replica killed during a burst of applies (issue 26, fault tests): admission keeps answering.

Two operator processes serve the webhook (serve mode, one shared serving certificate for 127.0.0.1) behind
``devcluster.balancer.Balancer``, the local STAND-IN for the chart's webhook Service (the local cluster has
no pod network the apiserver can reach). A ValidatingWebhookConfiguration for this test's namespace only
points at the balancer, failurePolicy Fail. During a burst of server-side dry-run applies (valid and
invalid manifests) the replica holding the apiserver's connections is SIGKILLed. Every answer is the right
verdict (valid admitted, invalid denied by the matrix rule), except that a call the killed replica held at
that instant may fail as a broken connection: the apiserver retries no webhook POST (client-go retries
resets for GETs only), behind a real Service too. Every apply begun after the kill gets its verdict.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pdfleet_devcluster import LocalCluster
from pdfleet_devcluster.balancer import Balancer
from pdfleet_devcluster.cluster import free_port
from pdfleet_operator.admission.handlers import VALIDATE_WEBHOOK_ID
from pdfleet_operator.certs import CertificateAuthority
from pdfleet_runtime.lifetime import die_with_parent
from tests.helpers import wait_until

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
VALID = REPO / "examples" / "valid" / "llama-dense.yaml"
INVALID = REPO / "examples" / "invalid" / "nixl.replicated-hetero-tp.yaml"
CONCURRENCY = 3  # applies at once
KILL_REACH_S = 1.0  # an apply begun this soon after the kill may still meet a connection the kill broke


def _replica(tmp: Path, name: str, port: int, certs: Path, watch: str, kubeconfig: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "pdfleet_operator", "--standalone", "--namespace", watch,
           "--webhook-listen", f"127.0.0.1:{port}", "--webhook-cert-dir", str(certs),
           "--liveness", f"http://127.0.0.1:{free_port()}/healthz", "--metrics-listen", ""]
    log = (tmp / f"{name}.log").open("wb")
    # A session of its own: killing a replica kills its process group, the operator and its admission
    # process together, as the kubelet kills every process of a killed pod's container.
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tmp, preexec_fn=die_with_parent,
                            env={**os.environ, "KUBECONFIG": str(kubeconfig)}, start_new_session=True)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the replica's process group (the operator and its admission process), as a pod is killed."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture
def two_replicas(cluster: LocalCluster, crd: str, namespace: str, tmp_path: Path) -> Iterator[tuple[Balancer, dict]]:
    ca = CertificateAuthority(tmp_path / "ca", name="burst-webhook-ca")
    pair = ca.issue("webhook", common_name="127.0.0.1", ips=("127.0.0.1",), dns=("localhost",))
    certs = tmp_path / "certs"
    certs.mkdir()
    (certs / "tls.crt").write_bytes(pair.cert_path.read_bytes())
    (certs / "tls.key").write_bytes(pair.key_path.read_bytes())
    idle = f"{namespace}-none"  # the replicas reconcile nothing: the burst is dry runs
    ports = [free_port(), free_port()]
    procs = {p: _replica(tmp_path, f"replica-{i}", p, certs, idle, cluster.kubeconfig) for i, p in enumerate(ports)}
    balancer = Balancer(ports)
    balancer.start()
    name = f"burst-{namespace}.pdfleet.io"
    vwc = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
           "metadata": {"name": name},
           "webhooks": [{"name": "validate-pddeployment.pdfleet.io", "admissionReviewVersions": ["v1"],
                         "sideEffects": "None", "failurePolicy": "Fail", "timeoutSeconds": 10,
                         "rules": [{"apiGroups": ["pdfleet.io"], "apiVersions": ["v1alpha1"],
                                    "resources": ["pddeployments"], "operations": ["CREATE", "UPDATE"]}],
                         "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                         "clientConfig": {"url": f"https://127.0.0.1:{balancer.port}/{VALIDATE_WEBHOOK_ID}",
                                          "caBundle": base64.b64encode(ca.cert_path.read_bytes()).decode()}}]}
    try:
        def listening() -> bool:
            for p, proc in procs.items():
                assert proc.poll() is None, (tmp_path / "replica-0.log").read_text()[-2000:]
                with socket.socket() as s:
                    if s.connect_ex(("127.0.0.1", p)) != 0:
                        return False
            return True

        wait_until(listening, what="both webhook replicas listening", timeout=60)
        cluster.kubectl("apply", "-f", "-", input=json.dumps(vwc))
        yield balancer, procs
    finally:
        cluster.kubectl("delete", "validatingwebhookconfiguration", name, "--ignore-not-found")
        balancer.stop()
        for proc in procs.values():
            _kill(proc)
            if proc.poll() is None:
                proc.wait(10)


def test_admission_keeps_answering_when_a_replica_is_killed(cluster: LocalCluster, namespace: str,
                                                            two_replicas: tuple[Balancer, dict]) -> None:
    balancer, procs = two_replicas

    def apply(path: Path) -> tuple[Path, float, subprocess.CompletedProcess[str]]:
        began = time.monotonic()
        return path, began, cluster.kubectl("-n", namespace, "apply", "--dry-run=server", "-f", str(path),
                                            check=False)

    def denied_through_the_balancer() -> bool:
        res = apply(INVALID)[2]
        return res.returncode != 0 and "[nixl.replicated-hetero-tp]" in res.stderr

    wait_until(denied_through_the_balancer, what="the webhook answering through the balancer", timeout=30)
    manifests = [VALID if i % 3 else INVALID for i in range(48)]
    killed: list[int] = []
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        futures = [pool.submit(apply, m) for m in manifests]
        while sum(f.done() for f in futures) < 10:
            time.sleep(0.05)
        victim = max(balancer.connections, key=lambda p: balancer.connections[p])  # the one serving now
        served_by_victim = balancer.connections[victim]
        _kill(procs[victim])
        killed_at = time.monotonic()
        killed.append(victim)
        left_at_kill = sum(not f.done() for f in futures)
        results = [f.result() for f in futures]
    assert served_by_victim >= 1 and left_at_kill >= 10, (served_by_victim, left_at_kill)
    assert killed and procs[killed[0]].wait(10) is not None
    wrong, broken = [], []
    for path, began, res in results:
        if res.returncode != 0 and "failed calling webhook" in res.stderr and began < killed_at + KILL_REACH_S:
            broken.append(res.stderr.strip())  # held by the killed replica: a broken connection, no verdict
        elif path == VALID and res.returncode != 0:
            wrong.append(f"valid denied: {res.stderr.strip()[:300]}")
        elif path == INVALID and "[nixl.replicated-hetero-tp]" not in res.stderr:
            wrong.append(f"invalid not denied by the matrix rule: {res.returncode} {res.stderr.strip()[:300]}")
    assert not wrong, f"{len(wrong)} of {len(results)} wrong answers, e.g. {wrong[:3]}"
    # At most the calls in flight at the kill (no more than the burst's concurrency), and only as broken connections.
    assert len(broken) <= CONCURRENCY, broken
    cut = ("EOF", "connection reset", "broken pipe", "server closed idle connection")
    assert all(any(c in b for c in cut) for b in broken), broken
    after = [r for _, began, r in results if began >= killed_at + KILL_REACH_S]
    survivor = next(p for p in procs if p not in killed)
    assert balancer.connections[survivor] >= 1, balancer.connections
    assert len(after) >= 3, f"only {len(after)} applies began {KILL_REACH_S} s after the kill: the burst is too short"

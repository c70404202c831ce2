"""The local control plane is a real one: schema and CEL validation, admission
webhooks, workloads that schedule onto kwok GPU nodes and roll, garbage
collection, and readiness gates that hold pods NotReady until patched True.
"""

from __future__ import annotations

import base64
import json
import ssl
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from pdfleet_devcluster import LocalCluster
from pdfleet_operator.certs import CertificateAuthority
from tests.helpers import wait_until

pytestmark = pytest.mark.cluster


def _get(cluster: LocalCluster, ns: str, *what: str) -> dict:
    return json.loads(cluster.kubectl("-n", ns, "get", *what, "-o", "json").stdout)


def test_server_version_is_the_built_release(cluster: LocalCluster) -> None:
    from pdfleet_devcluster.toolchain import PINS

    version = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == PINS.kubernetes
    assert version["clientVersion"]["gitVersion"] == PINS.kubernetes


def test_kwok_nodes_are_ready_with_gpus(cluster: LocalCluster) -> None:
    nodes = json.loads(cluster.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    assert len(nodes) == 3
    for node in nodes:
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
        ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"]
        assert ready == "True"


CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.test.pdfleet.io"},
    "spec": {
        "group": "test.pdfleet.io",
        "names": {"kind": "Widget", "plural": "widgets", "singular": "widget"},
        "scope": "Namespaced",
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "properties": {
                                    "prefillTP": {"type": "integer", "minimum": 1},
                                    "decodeTP": {"type": "integer", "minimum": 1},
                                },
                                "x-kubernetes-validations": [
                                    {
                                        "rule": "self.prefillTP % self.decodeTP == 0 || self.decodeTP % self.prefillTP == 0",
                                        "message": "TP sizes must divide one another",
                                    }
                                ],
                            }
                        },
                    }
                },
            }
        ],
    },
}


def test_crd_schema_and_cel_reject_with_apiserver_message(cluster: LocalCluster, namespace: str) -> None:
    cluster.kubectl("apply", "-f", "-", input=json.dumps(CRD))
    cluster.wait_established("widgets.test.pdfleet.io")

    def widget(p: int, d: int) -> str:
        return json.dumps(
            {
                "apiVersion": "test.pdfleet.io/v1",
                "kind": "Widget",
                "metadata": {"name": f"w{p}-{d}", "namespace": namespace},
                "spec": {"prefillTP": p, "decodeTP": d},
            }
        )

    # The CRD may take a moment to be served after Established.
    wait_until(
        lambda: cluster.kubectl("apply", "-f", "-", input=widget(4, 2), check=False).returncode == 0,
        what="a valid Widget to be accepted",
    )
    bad = cluster.kubectl("apply", "-f", "-", input=widget(4, 3), check=False)
    assert bad.returncode != 0
    assert "TP sizes must divide one another" in bad.stderr
    schema = cluster.kubectl("apply", "-f", "-", input=widget(0, 1), check=False)
    assert schema.returncode != 0
    assert "should be greater than or equal to 1" in schema.stderr


class _DenyHandler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        review = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        obj = review["request"]["object"]
        deny = obj.get("metadata", {}).get("labels", {}).get("deny") == "yes"
        response = {"uid": review["request"]["uid"], "allowed": not deny}
        if deny:
            response["status"] = {"code": 403, "message": "denied by the test webhook: label deny=yes"}
        body = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def webhook(tmp_path: Path) -> Iterator[tuple[int, bytes]]:
    ca = CertificateAuthority(tmp_path / "pki", name="webhook-ca")
    leaf = ca.issue("webhook", common_name="webhook", ips=("127.0.0.1",), dns=("localhost",))
    server = ThreadingHTTPServer(("127.0.0.1", 0), _DenyHandler)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(leaf.cert_path, leaf.key_path)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1], ca.cert_pem
    server.shutdown()


def test_validating_webhook_over_tls_denies_with_its_message(
    cluster: LocalCluster, namespace: str, webhook: tuple[int, bytes]
) -> None:
    port, ca_pem = webhook
    name = f"deny-{uuid.uuid4().hex[:6]}"
    cfg = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": [
            {
                "name": "deny.test.pdfleet.io",
                "clientConfig": {"url": f"https://127.0.0.1:{port}/validate", "caBundle": base64.b64encode(ca_pem).decode()},
                "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["configmaps"]}],
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                "failurePolicy": "Fail",
                "sideEffects": "None",
                "admissionReviewVersions": ["v1"],
                "timeoutSeconds": 5,
            }
        ],
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(cfg))
    try:
        def cm(label: str, n: str) -> str:
            return json.dumps({"apiVersion": "v1", "kind": "ConfigMap",
                               "metadata": {"name": n, "namespace": namespace, "labels": {"deny": label}}})

        # Webhook configurations are picked up asynchronously by the apiserver.
        def denied() -> str | None:
            out = cluster.kubectl("create", "-f", "-", input=cm("yes", f"bad-{uuid.uuid4().hex[:6]}"), check=False)
            return out.stderr if out.returncode != 0 else None

        stderr = wait_until(denied, what="the webhook to deny")
        assert "denied by the test webhook: label deny=yes" in stderr
        assert 'admission webhook "deny.test.pdfleet.io" denied the request' in stderr
        cluster.kubectl("create", "-f", "-", input=cm("no", "good"))
    finally:
        cluster.kubectl("delete", "validatingwebhookconfiguration", name, check=False)


def _deployment(namespace: str, image: str) -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "gpu-app", "namespace": namespace},
            "spec": {
                "replicas": 3,
                "selector": {"matchLabels": {"app": "gpu-app"}},
                "template": {
                    "metadata": {"labels": {"app": "gpu-app"}},
                    "spec": {
                        "containers": [
                            {"name": "main", "image": image, "resources": {"limits": {"nvidia.com/gpu": "2"}}}
                        ]
                    },
                },
            },
        }
    )


def _ready_pods(cluster: LocalCluster, ns: str, selector: str) -> list[dict]:
    pods = _get(cluster, ns, "pods", "-l", selector)["items"]
    return [
        p for p in pods
        if "deletionTimestamp" not in p["metadata"]
        and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))
    ]


def test_gpu_deployment_becomes_ready_and_rolls(cluster: LocalCluster, namespace: str) -> None:
    cluster.kubectl("apply", "-f", "-", input=_deployment(namespace, "example.invalid/app:v1"))
    pods = wait_until(lambda: len(_ready_pods(cluster, namespace, "app=gpu-app")) == 3 and
                      _ready_pods(cluster, namespace, "app=gpu-app"), what="3 Ready pods", timeout=90)
    assert all(p["spec"]["nodeName"].startswith("kwok-gpu-") for p in pods)
    first_rs = {p["metadata"]["ownerReferences"][0]["name"] for p in pods}
    assert len(first_rs) == 1

    cluster.kubectl("apply", "-f", "-", input=_deployment(namespace, "example.invalid/app:v2"))
    cluster.kubectl("-n", namespace, "rollout", "status", "deployment/gpu-app", "--timeout=120s", timeout=130)

    def rolled() -> list[dict] | None:
        ready = _ready_pods(cluster, namespace, "app=gpu-app")
        images = {p["spec"]["containers"][0]["image"] for p in ready}
        return ready if len(ready) == 3 and images == {"example.invalid/app:v2"} else None

    pods = wait_until(rolled, what="3 Ready pods on v2", timeout=90)
    new_rs = {p["metadata"]["ownerReferences"][0]["name"] for p in pods}
    assert len(new_rs) == 1 and new_rs.isdisjoint(first_rs)
    replicasets = _get(cluster, namespace, "replicasets", "-l", "app=gpu-app")["items"]
    assert {rs["metadata"]["name"] for rs in replicasets} >= first_rs | new_rs


def test_deleting_owner_garbage_collects_dependents(cluster: LocalCluster, namespace: str) -> None:
    owner = json.loads(cluster.kubectl("-n", namespace, "create", "configmap", "owner", "-o", "json").stdout)
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner["metadata"]["uid"]}
    deps = [
        {"apiVersion": "v1", "kind": "ConfigMap",
         "metadata": {"name": f"dep-{i}", "namespace": namespace, "ownerReferences": [ref]}}
        for i in range(3)
    ]
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(deps))
    assert len(_get(cluster, namespace, "configmaps", "-o", "name")["items"]) >= 4
    cluster.kubectl("-n", namespace, "delete", "configmap", "owner")

    def gone() -> bool:
        names = {c["metadata"]["name"] for c in _get(cluster, namespace, "configmaps")["items"]}
        return not names & {"dep-0", "dep-1", "dep-2"}

    wait_until(gone, what="dependents garbage-collected", timeout=60)


def _gated_pod(namespace: str, name: str, annotations: dict[str, str] | None = None) -> str:
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "annotations": annotations or {}},
            "spec": {
                "readinessGates": [{"conditionType": "pdfleet.io/transfer-path"}],
                "containers": [{"name": "main", "image": "example.invalid/runtime:v1"}],
            },
        }
    )


def _condition(pod: dict, kind: str) -> str | None:
    return next((c["status"] for c in pod["status"].get("conditions", []) if c["type"] == kind), None)


def _patch_gate(cluster: LocalCluster, namespace: str, name: str, status: str) -> None:
    patch = {"status": {"conditions": [{"type": "pdfleet.io/transfer-path", "status": status}]}}
    cluster.kubectl("-n", namespace, "patch", "pod", name, "--subresource=status",
                    "--type=strategic", "-p", json.dumps(patch))


def test_readiness_gate_holds_pod_until_patched_true(cluster: LocalCluster, namespace: str) -> None:
    cluster.kubectl("apply", "-f", "-", input=_gated_pod(namespace, "gated"))
    pod = wait_until(
        lambda: (p := _get(cluster, namespace, "pod", "gated"))["status"].get("phase") == "Running" and p,
        what="gated pod Running",
    )
    assert _condition(pod, "ContainersReady") == "True"
    assert _condition(pod, "Ready") == "False"

    _patch_gate(cluster, namespace, "gated", "False")
    # Give kwok a chance to (wrongly) flip it; it must stay NotReady.
    wait_until(lambda: _condition(_get(cluster, namespace, "pod", "gated"), "pdfleet.io/transfer-path") == "False",
               what="gate condition False recorded")
    assert _condition(_get(cluster, namespace, "pod", "gated"), "Ready") == "False"

    _patch_gate(cluster, namespace, "gated", "True")
    wait_until(lambda: _condition(_get(cluster, namespace, "pod", "gated"), "Ready") == "True",
               what="Ready after the gate turned True")

    _patch_gate(cluster, namespace, "gated", "False")
    wait_until(lambda: _condition(_get(cluster, namespace, "pod", "gated"), "Ready") == "False",
               what="NotReady again after the gate turned False")


def test_pod_deletion_can_be_held(cluster: LocalCluster, namespace: str) -> None:
    cluster.kubectl("apply", "-f", "-", input=_gated_pod(namespace, "held", {"pdfleet.io/hold-deletion": "test"}))
    wait_until(lambda: _get(cluster, namespace, "pod", "held")["status"].get("phase") == "Running",
               what="held pod Running")
    cluster.kubectl("-n", namespace, "delete", "pod", "held", "--wait=false")
    pod = _get(cluster, namespace, "pod", "held")
    assert "deletionTimestamp" in pod["metadata"]
    import time

    time.sleep(2)  # kwok would delete an unheld pod within milliseconds
    assert cluster.kubectl("-n", namespace, "get", "pod", "held", check=False).returncode == 0
    cluster.kubectl("-n", namespace, "annotate", "pod", "held", "pdfleet.io/hold-deletion-")
    wait_until(lambda: cluster.kubectl("-n", namespace, "get", "pod", "held", check=False).returncode != 0,
               what="pod deleted once released")

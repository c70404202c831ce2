"""What a runtime pod's ServiceAccount may do, acting as it against the real apiserver (issue 26, item 1).

Tokens are minted with the TokenRequest API bound to a pod (boundObjectRef kind Pod), as the kubelet
mounts them: the apiserver then puts the pod's name in the caller's user extra
``authentication.kubernetes.io/pod-name``. With such a token a runtime may read its own pod and
patch its own pod's ``pdfleet.io/*`` conditions; it may not touch a sibling pod of its deployment,
another deployment's pods, an unrelated app's pods (nor read that app's env), nor any condition
outside ``pdfleet.io/``. A token not bound to a pod may patch nothing.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from pdfleet_devcluster import LocalCluster
from pdfleet_runtime.config import DRAINED_CONDITION, READINESS_GATE
from tests.cluster.conftest import OperatorProcess
from tests.helpers import delete_namespace_and_pods, wait_until

pytestmark = pytest.mark.cluster

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "valid" / "llama-dense.yaml"


def _pods(cluster: LocalCluster, ns: str, deployment: str) -> list[dict]:
    out = cluster.kubectl("-n", ns, "get", "pods", "-l", f"pdfleet.io/deployment={deployment}", "-o", "json")
    return sorted((p for p in json.loads(out.stdout)["items"] if "deletionTimestamp" not in p["metadata"]),
                  key=lambda p: p["metadata"]["name"])


def _as(cluster: LocalCluster, token: str, *args: str, input: str | None = None):
    """kubectl with only this bearer token (the admin client certificate dropped)."""
    kc = yaml.safe_load(cluster.kubeconfig.read_text())
    kc["users"] = [{"name": "runtime", "user": {"token": token}}]
    for ctx in kc["contexts"]:
        ctx["context"]["user"] = "runtime"
    path = cluster.state_dir / f"token-{abs(hash(token)) % 10**8}.kubeconfig"
    path.write_text(yaml.safe_dump(kc))
    return cluster.kubectl(f"--kubeconfig={path}", *args, input=input, check=False)


def _patch_condition(cluster: LocalCluster, token: str, ns: str, pod: str, kind: str):
    patch = {"status": {"conditions": [{"type": kind, "status": "True", "reason": "Forged", "message": "x"}]}}
    return _as(cluster, token, "-n", ns, "patch", "pod", pod, "--subresource=status", "--type=strategic",
               "-p", json.dumps(patch))


@pytest.fixture(scope="module")
def fleets(cluster: LocalCluster, operator: OperatorProcess) -> Iterator[str]:
    """Two deployments and an unrelated pod in a namespace of their own, deleted at the end: their pods
    hold GPUs on the worker's shared cluster, which the next test file's pods may need."""
    ns = "runtime-permissions"
    cluster.kubectl("create", "namespace", ns)
    wait_until(lambda: cluster.kubectl("-n", ns, "get", "sa", "default", check=False).returncode == 0,
               what="default ServiceAccount")
    base = yaml.safe_load(EXAMPLE.read_text())
    for name in ("alpha", "beta"):
        obj = {**base, "metadata": {"name": name, "namespace": ns}}
        cluster.kubectl("apply", "-f", "-", input=json.dumps(obj))
    app = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "unrelated-app", "namespace": ns},
           "spec": {"containers": [{"name": "c", "image": "example.invalid/app:1",
                                    "env": [{"name": "DB_PASSWORD", "value": "hunter2"}]}]}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(app))
    for name in ("alpha", "beta"):
        wait_until(lambda name=name: len(_pods(cluster, ns, name)) == 3, what=f"{name}'s 3 pods", timeout=60)
    yield ns
    delete_namespace_and_pods(cluster, ns)


def _token(cluster: LocalCluster, ns: str, sa: str, pod: dict | None) -> str:
    args = ["-n", ns, "create", "token", sa, "--duration=10m"]
    if pod is not None:
        args += ["--bound-object-kind=Pod", f"--bound-object-name={pod['metadata']['name']}",
                 f"--bound-object-uid={pod['metadata']['uid']}"]
    return cluster.kubectl(*args).stdout.strip()


def test_a_runtime_reaches_only_its_own_pods_pdfleet_conditions(cluster: LocalCluster, fleets: str) -> None:
    ns = fleets
    mine, sibling = _pods(cluster, ns, "alpha")[:2]
    other = _pods(cluster, ns, "beta")[0]
    sa = mine["spec"]["serviceAccountName"]
    token = _token(cluster, ns, sa, mine)
    me = mine["metadata"]["name"]

    # Its own pod: read it (the drain request is in its annotations) and set its pdfleet.io conditions.
    assert _as(cluster, token, "-n", ns, "get", "pod", me).returncode == 0
    for kind in (READINESS_GATE, DRAINED_CONDITION):
        res = _patch_condition(cluster, token, ns, me, kind)
        assert res.returncode == 0, res.stderr

    refused = {
        "its own pod's Ready condition": _patch_condition(cluster, token, ns, me, "Ready"),
        "a sibling pod's gate": _patch_condition(cluster, token, ns, sibling["metadata"]["name"], READINESS_GATE),
        "a sibling pod's drained": _patch_condition(cluster, token, ns, sibling["metadata"]["name"],
                                                    DRAINED_CONDITION),
        "another deployment's pod": _patch_condition(cluster, token, ns, other["metadata"]["name"], DRAINED_CONDITION),
        "an unrelated app's pod": _patch_condition(cluster, token, ns, "unrelated-app", READINESS_GATE),
        "reading an unrelated app's env": _as(cluster, token, "-n", ns, "get", "pod", "unrelated-app", "-o", "json"),
        "listing pods": _as(cluster, token, "-n", ns, "get", "pods"),
    }
    allowed = {what: r.stdout[:200] for what, r in refused.items() if r.returncode == 0}
    assert not allowed, f"a runtime's token was allowed: {allowed}"
    for what, r in refused.items():
        assert "forbidden" in r.stderr.lower() or "denied" in r.stderr.lower(), (what, r.stderr)
    # A token of the same ServiceAccount that is not bound to a pod names no pod: it may patch nothing.
    unbound = _token(cluster, ns, sa, None)
    res = _patch_condition(cluster, unbound, ns, me, READINESS_GATE)
    assert res.returncode != 0, "an unbound token patched a pod's status"

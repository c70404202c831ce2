"""The operator resolves a Hub branch once (issue 47), against the real apiserver and a stand-in of the Hub's
revision API on loopback (``--hub-endpoint``; no network).

A PDDeployment on branch ``main`` gets ``status.model`` (the commit) and pods rendering ``--revision COMMIT``;
the branch moving on the Hub changes nothing in the fleet (never re-resolved); the field changed to a tag
resolves again, and the new commit reaches new pods; a name the Hub does not know makes ``Degraded``
(``ModelRevisionUnresolved``, naming the model and the fix) and keeps the pods that run.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdfleet_devcluster import LocalCluster
from pdfleet_devcluster.local_operator import LocalOperator
from tests.hub_standin import MODEL, A, B, Hub, running_hub

pytestmark = pytest.mark.cluster

NAME = "hubref"


@pytest.fixture(scope="module")
def hub() -> Iterator[Hub]:
    with running_hub() as h:
        yield h


@pytest.fixture(scope="module")
def hub_operator(cluster: LocalCluster, crd: str, hub: Hub, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[LocalOperator]:
    op = LocalOperator(cluster, tmp_path_factory.mktemp("operator"))
    op.start("--hub-endpoint", hub.endpoint, "--resync-seconds", "2")
    try:
        yield op
    finally:
        op.stop()


def manifest(ns: str, revision: str) -> dict:
    pool = {"maxConcurrentRequests": 8, "kvTokensPerReplica": 2048}
    role = {"replicas": 1, "parallelism": {"tensor": 1}, "image": "host", "pool": pool}
    return {
        "apiVersion": "pdfleet.io/v1alpha1", "kind": "PDDeployment", "metadata": {"name": NAME, "namespace": ns},
        "spec": {
            "engine": {"kind": "sglang", "version": "0.5.23", "image": "lmsysorg/sglang:v0.5.23"},
            "model": {"layout": {"preset": "llama-dense"}, "servedName": "tiny",
                      "source": {"huggingFace": {"id": MODEL, "revision": revision}}},
            "transfer": {"backend": "mooncake", "protocol": "tcp"},
            "router": {"image": "host"},
            "prefill": role, "decode": role,
        },
    }


def _get(cluster: LocalCluster, ns: str) -> dict:
    return json.loads(cluster.kubectl("-n", ns, "get", "pdd", NAME, "-o", "json").stdout)


def _revisions_in_pods(cluster: LocalCluster, ns: str) -> dict[str, str]:
    """pod name -> the --revision its engine container renders."""
    pods = json.loads(cluster.kubectl("-n", ns, "get", "pods", "-l", f"pdfleet.io/deployment={NAME}",
                                      "-o", "json").stdout)["items"]
    out = {}
    for p in pods:
        for c in p["spec"]["containers"]:
            cmd = c.get("command") or []
            if c["name"] == "engine" and "--revision" in cmd:
                out[p["metadata"]["name"]] = cmd[cmd.index("--revision") + 1]
    return out


def _wait(what: str, cond: Any, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := cond():
            return got
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_branch_is_resolved_once_and_a_new_name_rolls(cluster: LocalCluster, namespace: str, hub: Hub,
                                                        hub_operator: LocalOperator, tmp_path: Path) -> None:
    hub.refs.update({"main": A, "v2": B})
    path = tmp_path / "pdd.json"
    path.write_text(json.dumps(manifest(namespace, "main")))
    cluster.kubectl("apply", "-f", str(path))
    model = _wait("status.model", lambda: (_get(cluster, namespace).get("status") or {}).get("model"))
    assert model["id"] == MODEL and model["requested"] == "main" and model["commit"] == A, model
    pods = _wait("pods rendering the commit", lambda: (r := _revisions_in_pods(cluster, namespace)) and
                 len(r) >= 2 and r)
    assert set(pods.values()) == {A}, pods
    asked = len(hub.seen)
    assert asked == 1, hub.seen

    hub.refs["main"] = B  # the branch moves on the Hub: the fleet does not follow it
    time.sleep(6)  # three resyncs (--resync-seconds 2) at least
    assert len(hub.seen) == asked, hub.seen
    assert (_get(cluster, namespace)["status"]["model"]["commit"], set(_revisions_in_pods(cluster, namespace)
                                                                      .values())) == (A, {A})

    cluster.kubectl("-n", namespace, "patch", "pdd", NAME, "--type=merge", "-p",
                    json.dumps({"spec": {"model": {"source": {"huggingFace": {"revision": "v2"}}}}}))
    model = _wait("status.model for v2", lambda: (m := _get(cluster, namespace)["status"]["model"])["requested"]
                  == "v2" and m)
    assert model["commit"] == B, model
    _wait("a pod rendering the new commit", lambda: B in _revisions_in_pods(cluster, namespace).values())
    assert len(hub.seen) == asked + 1, hub.seen

    def settled() -> dict[str, str] | None:  # the rollout to B made what it can (no pod gets ready here)
        first = _revisions_in_pods(cluster, namespace)
        time.sleep(2)
        return first if first == _revisions_in_pods(cluster, namespace) else None

    before = _wait("the pods settled", settled)
    cluster.kubectl("-n", namespace, "patch", "pdd", NAME, "--type=merge", "-p",
                    json.dumps({"spec": {"model": {"source": {"huggingFace": {"revision": "nope"}}}}}))

    def degraded() -> dict | None:
        conds = {c["type"]: c for c in _get(cluster, namespace)["status"].get("conditions") or []}
        d = conds.get("Degraded")
        return d if d and d["status"] == "True" and d.get("reason") == "ModelRevisionUnresolved" else None

    cond = _wait("Degraded ModelRevisionUnresolved", degraded)
    assert "HTTP 404" in cond["message"] and MODEL in cond["message"] and "huggingFace.revision" in cond["message"]
    time.sleep(3)
    assert _revisions_in_pods(cluster, namespace) == before  # what runs keeps running, nothing new is made
    assert _get(cluster, namespace)["status"]["model"]["commit"] == B

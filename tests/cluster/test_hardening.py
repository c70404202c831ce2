"""Hardening on the real control plane: generated objects pass a server-side dry run, pod
privileges follow the protocol (checked against Pod Security Admission too), and a role that can
never be placed is reported Degraded with its reason within one reconcile.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from pdfleet_devcluster import LocalCluster
from pdfleet_operator.api.models import PDDeploymentSpec
from pdfleet_operator.plan import ActionKind, Owner, Snapshot, plan
from tests.cluster.conftest import OperatorProcess
from tests.helpers import wait_until

pytestmark = pytest.mark.cluster

VALID = sorted((Path(__file__).resolve().parents[2] / "examples" / "valid").glob("*.yaml"))
BASE = yaml.safe_load((VALID[0].parent / "llama-dense.yaml").read_text())
# A backend that serves each protocol (mooncake has no shm, see `pdfleet matrix`).
PROTOCOLS = {"rdma": "mooncake", "tcp": "mooncake", "nvlink": "nixl", "shm": "nixl"}


def _bodies(ns: str, spec: PDDeploymentSpec) -> list[dict]:
    return [a.body for a in plan(Owner("demo", ns, "00000000-0000-0000-0000-000000000001"), spec, Snapshot())
            if a.body is not None and a.kind is not ActionKind.PATCH_LABELS]


def _create_service_account(cluster: LocalCluster, bodies: list[dict]) -> None:
    """Really create the runtime ServiceAccount, without the owner reference: its owner does not
    exist here, and the garbage collector would delete it under the test."""
    sa = copy.deepcopy(next(b for b in bodies if b["kind"] == "ServiceAccount"))
    sa["metadata"].pop("ownerReferences")
    cluster.kubectl("apply", "-f", "-", input=json.dumps(sa))


@pytest.mark.parametrize("path", VALID, ids=lambda p: p.stem)
def test_generated_objects_pass_server_side_dry_run(cluster: LocalCluster, namespace: str, path: Path) -> None:
    spec = PDDeploymentSpec.model_validate(yaml.safe_load(path.read_text())["spec"])
    bodies = _bodies(namespace, spec)
    others = [b for b in bodies if b["kind"] != "Pod"]
    pods = [b for b in bodies if b["kind"] == "Pod"]
    # The pods' ServiceAccount must exist for the ServiceAccount admission plugin; the rest is dry-run.
    _create_service_account(cluster, others)
    for batch in (others, pods):
        out = cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump_all(batch), check=False)
        assert out.returncode == 0, out.stderr
        assert out.stdout.count("(server dry run)") == len(batch)


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_pod_privileges_follow_the_protocol(cluster: LocalCluster, namespace: str, protocol: str) -> None:
    raw = copy.deepcopy(BASE["spec"])
    raw["transfer"] = {"backend": PROTOCOLS[protocol], "protocol": protocol}
    pods = [b for b in _bodies(namespace, PDDeploymentSpec.model_validate(raw)) if b["kind"] == "Pod"]
    _create_service_account(cluster, _bodies(namespace, PDDeploymentSpec.model_validate(raw)))
    out = cluster.kubectl("apply", "--dry-run=server", "-o", "json", "-f", "-",
                          input=yaml.safe_dump_all(pods))
    served = json.loads(out.stdout)
    for pod in served.get("items", [served]):
        spec, c = pod["spec"], pod["spec"]["containers"][0]
        sc = c["securityContext"]
        assert not spec.get("hostNetwork") and not spec.get("hostPID") and sc["privileged"] is False
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert sc["capabilities"].get("add", []) == (["IPC_LOCK"] if protocol == "rdma" else [])
        assert ("rdma/rdma_shared_device_a" in c["resources"]["limits"]) is (protocol == "rdma")
        assert bool(spec.get("hostIPC")) is (protocol == "nvlink")

    # Pod Security Admission agrees: tcp/shm pods meet `restricted`; rdma needs IPC_LOCK and nvlink
    # needs hostIPC, which `restricted` (and for hostIPC also `baseline`) refuse, by design.
    cluster.kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted", "--overwrite")
    try:
        res = cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump_all(pods), check=False)
        if protocol in ("tcp", "shm"):
            assert res.returncode == 0, res.stderr
        else:
            assert res.returncode != 0
            assert ("IPC_LOCK" if protocol == "rdma" else "hostIPC") in res.stderr
    finally:
        cluster.kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/enforce-", "--overwrite")


UNPLACEABLE = {
    "NoMatchingNodes": {"nodeSelector": {"pdfleet.io/no-such-pool": "x"}},
    "InsufficientGPUsPerNode": {"parallelism": {"tensor": 16}},
    "PoolExceedsGPUMemory": {"gpuMemoryGiB": 400, "pool": {"kvTokensPerReplica": 3 << 20}},
}


@pytest.mark.parametrize("reason", sorted(UNPLACEABLE))
def test_unplaceable_roles_are_degraded_with_reason(
    cluster: LocalCluster, operator: OperatorProcess, namespace: str, reason: str
) -> None:
    obj = copy.deepcopy(BASE)
    obj["metadata"] = {"name": "unplaceable", "namespace": namespace}
    obj["spec"]["decode"].update(UNPLACEABLE[reason])
    cluster.kubectl("apply", "-f", "-", input=json.dumps(obj))

    def degraded() -> dict | None:
        got = json.loads(cluster.kubectl("-n", namespace, "get", "pdd", "unplaceable", "-o", "json").stdout)
        conds = {c["type"]: c for c in (got.get("status") or {}).get("conditions") or ()}
        return conds.get("Degraded") if conds.get("Degraded", {}).get("status") == "True" else None

    # One reconcile: the create handler's pass writes it (no resync needed).
    cond = wait_until(degraded, what=f"Degraded={reason}", timeout=20)
    assert cond["reason"] == reason
    assert "decode" in cond["message"]
    cluster.kubectl("-n", namespace, "delete", "pdd", "unplaceable")

"""The generated PDDeployment CRD on the real apiserver: accepted as structural, Established, its
schema and CEL rules enforce what `pdfleet validate` says they do, defaults are filled in, the
subresources and printer columns work, and `kubectl explain` shows the descriptions.

No webhook is installed here: matrix-only rules are the webhook's job (issue 4), so only examples
whose expected violations are all schema or CEL rules are checked for denial.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from pdfleet_devcluster import LocalCluster
from pdfleet_operator.api.crd import CRD_FILE, CRD_NAME
from pdfleet_operator.api.rules import CEL_RULES
from tests.helpers import wait_until

pytestmark = pytest.mark.cluster

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
APISERVER_RULES = {r.id for r in CEL_RULES} | {"schema", "document", "yaml"}


def _expected(path: Path) -> list[tuple[str, str]]:
    return re.findall(r"^# expect-violation: (\S+) ?(\S*)$", path.read_text(), re.M)


STRUCTURAL_INVALID = [
    p
    for p in sorted((EXAMPLES / "invalid").glob("*.yaml"))
    if all(rule in APISERVER_RULES for rule, _ in _expected(p))
]


@pytest.fixture(scope="module")
def crd(cluster: LocalCluster) -> str:
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))
    cluster.wait_established(CRD_NAME)
    # discovery and the OpenAPI document lag Established by a moment
    wait_until(lambda: cluster.kubectl("get", "pdd", "-A", check=False).returncode == 0, what="pdd discovery")
    return CRD_NAME


def test_crd_is_structural_and_established(cluster: LocalCluster, crd: str) -> None:
    obj = json.loads(cluster.kubectl("get", "crd", crd, "-o", "json").stdout)
    conditions = {c["type"]: c["status"] for c in obj["status"]["conditions"]}
    assert conditions.get("Established") == "True"
    assert conditions.get("NonStructuralSchema", "False") == "False"
    assert conditions.get("NamesAccepted") == "True"


@pytest.mark.parametrize("path", sorted((EXAMPLES / "valid").glob("*.yaml")), ids=lambda p: p.stem)
def test_valid_examples_pass_server_dry_run(
    cluster: LocalCluster, crd: str, namespace: str, path: Path
) -> None:
    proc = cluster.kubectl("-n", namespace, "apply", "--dry-run=server", "-f", str(path), check=False)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("path", STRUCTURAL_INVALID, ids=lambda p: p.stem)
def test_structural_invalid_examples_are_denied_by_the_apiserver(
    cluster: LocalCluster, crd: str, namespace: str, path: Path
) -> None:
    proc = cluster.kubectl("-n", namespace, "apply", "--dry-run=server", "-f", str(path), check=False)
    assert proc.returncode != 0, f"{path.name} was admitted"
    for rule, field in _expected(path):
        if rule in {r.id for r in CEL_RULES}:
            assert f"{rule}:" in proc.stderr, proc.stderr  # the CEL message starts with the rule id
        if rule in {r.id for r in CEL_RULES} | {"schema"} and field:
            assert field in proc.stderr, proc.stderr


def test_cel_violation_message(cluster: LocalCluster, crd: str, namespace: str) -> None:
    path = EXAMPLES / "invalid" / "tp-divisible.yaml"
    proc = cluster.kubectl("-n", namespace, "apply", "--dry-run=server", "-f", str(path), check=False)
    assert proc.returncode != 0
    assert "spec.decode.parallelism.tensor" in proc.stderr
    assert "tp-divisible: prefill and decode parallelism.tensor must divide one another" in proc.stderr


def test_defaults_subresources_and_columns(cluster: LocalCluster, crd: str, namespace: str) -> None:
    manifest = (EXAMPLES / "valid" / "llama-dense.yaml").read_text()
    cluster.kubectl("-n", namespace, "apply", "-f", "-", input=manifest)
    name = yaml.safe_load(manifest)["metadata"]["name"]
    obj = json.loads(cluster.kubectl("-n", namespace, "get", "pdd", name, "-o", "json").stdout)
    spec = obj["spec"]
    assert spec["transfer"]["protocol"] == "rdma"
    assert spec["decode"]["parallelism"]["pipeline"] == 1 and spec["decode"]["gpuMemoryGiB"] == 141
    assert spec["decode"]["pool"] == {"maxConcurrentRequests": 64, "kvTokensPerReplica": 131072}
    assert spec["rollout"]["maxSurge"] == 1 and spec["rollout"]["paused"] is False
    cluster.kubectl("-n", namespace, "scale", f"pdd/{name}", "--replicas=5")
    obj = json.loads(cluster.kubectl("-n", namespace, "get", "pdd", name, "-o", "json").stdout)
    assert obj["spec"]["decode"]["replicas"] == 5
    status = {
        "status": {
            "prefillReady": "1/1",
            "decodeReady": "0/5",
            "shapes": "P tp4xpp1 / D tp2xpp1",
            "endpoint": "http://llama-router.ns.svc:30000",
            "decode": {"replicas": 5, "ready": 0, "updated": 5, "selector": "pdfleet.io/role=decode"},
        }
    }
    cluster.kubectl(
        "-n",
        namespace,
        "patch",
        "pdd",
        name,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps(status),
    )
    table = cluster.kubectl("-n", namespace, "get", "pdd", name).stdout
    assert re.search(r"NAME\s+PREFILL\s+DECODE\s+BACKEND\s+SHAPES\s+AVAILABLE\s+ENDPOINT\s+AGE", table), table
    assert "P tp4xpp1 / D tp2xpp1" in table and "nixl" in table and "http://llama-router.ns.svc:30000" in table
    cluster.kubectl("-n", namespace, "delete", "pdd", name)


def test_kubectl_explain_shows_descriptions(cluster: LocalCluster, crd: str) -> None:
    def explain() -> str:
        proc = cluster.kubectl("explain", "pdd.spec.transfer", check=False)
        return proc.stdout if proc.returncode == 0 and "backend" in proc.stdout else ""

    out = " ".join(wait_until(explain, what="kubectl explain pdd.spec.transfer", timeout=60).split())
    assert "Transfer backend and protocol between prefill and decode." in out
    assert "backend <string> -required-" in out and "Transfer engine: mooncake" in out
    assert "protocol <string>" in out and "rdmaDevices <[]string>" in out
    proto = " ".join(cluster.kubectl("explain", "pdd.spec.transfer.protocol").stdout.split())
    assert "each backend maps it to its engine settings" in proto

"""A Qwen3.8 Flash Next SGLang PDDeployment on the real control plane: the operator (with its webhook)
creates pods whose ``engine`` command and environment are byte-for-byte what ``pdfleet render`` prints,
and the webhook denies what render denies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pdfleet_devcluster import LocalCluster
from pdfleet_operator.render import render_object
from tests.cluster.conftest import OperatorProcess
from tests.helpers import wait_until

pytestmark = pytest.mark.cluster

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
EXAMPLE = EXAMPLES / "valid" / "sglang-qwen3.8-flash-next.yaml"
NAME = "qwen3-8-flash-next-sglang"


def _engine(pod: dict) -> dict:
    (engine,) = [c for c in pod["spec"]["containers"] if c["name"] == "engine"]
    return engine


def test_pods_run_exactly_what_render_prints(cluster: LocalCluster, operator: OperatorProcess,
                                             namespace: str) -> None:
    obj = yaml.safe_load(EXAMPLE.read_text())
    obj["metadata"]["namespace"] = namespace
    rendered = {o["metadata"]["name"]: o for o in render_object(obj).objects if o["kind"] == "Pod"}
    assert len(rendered) == 3
    cluster.kubectl("-n", namespace, "apply", "-f", str(EXAMPLE))

    def pods() -> dict[str, dict]:
        items = json.loads(cluster.kubectl("-n", namespace, "get", "pods", "-l",
                                           f"pdfleet.io/deployment={NAME}", "-o", "json").stdout)["items"]
        return {p["metadata"]["name"]: p for p in items}

    live = wait_until(lambda: (p := pods()) and len(p) == 3 and p, what="3 SGLang pods", timeout=60)
    assert set(live) == set(rendered)  # same names: same revisions from the same defaulted spec
    for name, pod in live.items():
        want, got = _engine(rendered[name]), _engine(pod)
        assert json.dumps(got["command"]) == json.dumps(want["command"]), name
        assert json.dumps(got["env"]) == json.dumps(want["env"]), name
        assert got["image"] == "lmsysorg/sglang:v0.5.23"
        assert got["resources"]["limits"]["nvidia.com/gpu"] == want["resources"]["limits"]["nvidia.com/gpu"]
    prefill = [p for p in live.values() if p["metadata"]["labels"]["pdfleet.io/role"] == "prefill"]
    assert prefill[0]["metadata"]["annotations"]["sglang.ai/bootstrap-port"] == "8998"


def test_webhook_denies_what_render_denies(cluster: LocalCluster, operator: OperatorProcess,
                                           namespace: str) -> None:
    path = EXAMPLES / "invalid" / "engine-flag-unknown.yaml"
    assert not render_object(yaml.safe_load(path.read_text())).verdict.admitted
    proc = cluster.kubectl("-n", namespace, "apply", "-f", str(path), check=False)
    assert proc.returncode != 0 and "engine-flag-unknown" in proc.stderr, proc.stderr

"""``pdfleet render --diff``'s planner (``upgrade_diff``): the running pods against this release's rendering.

Live pods are rendered pods plus what the API server adds (defaults, status): those are not changes. A
rendering change (a volume's size) is one field on each role; an env var the new rendering drops is
reported as going; the release that made the pods reports nothing.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

import pdfleet_operator.resources.pods as pods
from pdfleet_operator.api.constants import Role
from pdfleet_operator.api.models import PDDeploymentSpec
from pdfleet_operator.resources.pods import runtime_pod
from pdfleet_operator.resources.revision import _digest, role_revision
from pdfleet_operator.resources.runtime_config import runtime_configmap
from pdfleet_operator.upgrade_diff import FieldChange, compare, role_diffs

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "valid" / "llama-dense.yaml"
NAME, NS = "llama", "team-a"


@pytest.fixture(autouse=True)
def fresh_cache() -> Iterator[None]:
    _digest.cache_clear()
    yield
    _digest.cache_clear()


def _spec() -> PDDeploymentSpec:
    return PDDeploymentSpec.model_validate(yaml.safe_load(EXAMPLE.read_text())["spec"])


def _live(spec: PDDeploymentSpec) -> tuple[list[dict], list[dict]]:
    """The fleet as the API server returns it: rendered now, with the server's defaults added."""
    out, maps = [], []
    for role in Role:
        rev = role_revision(spec, role)
        for index in range(2):
            pod = copy.deepcopy(runtime_pod(NAME, NS, spec, role, rev, index))
            pod["spec"].update(dnsPolicy="ClusterFirst", schedulerName="default-scheduler", nodeName="n1")
            for c in pod["spec"]["containers"]:
                c.update(imagePullPolicy="IfNotPresent", terminationMessagePath="/dev/termination-log")
            pod["metadata"]["uid"] = f"uid-{role.value}-{index}"
            pod["status"] = {"phase": "Running"}
            out.append(pod)
        maps.append(runtime_configmap(NAME, NS, spec, role, rev))
    return out, maps


def test_the_release_that_made_the_pods_changes_nothing() -> None:
    spec = _spec()
    diffs = role_diffs(NAME, NS, spec, *_live(spec))
    assert [(d.role, d.pods, d.rolls, d.changes) for d in diffs] == [(r, 2, False, ()) for r in Role]


def test_a_rendering_change_is_named_on_each_role(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _spec()
    live = _live(spec)
    _digest.cache_clear()
    monkeypatch.setattr(pods, "TMP_SIZE_LIMIT", "2Gi")
    diffs = role_diffs(NAME, NS, spec, *live)
    want = FieldChange(path="pod.spec.volumes[tmp].emptyDir.sizeLimit", running='"1Gi"', rendered='"2Gi"')
    assert all(d.rolls and d.changes == (want,) for d in diffs), diffs


def test_a_dropped_env_var_and_a_changed_config_are_reported() -> None:
    spec = _spec()
    live, maps = _live(spec)
    old = next(p for p in live if p["metadata"]["labels"]["pdfleet.io/role"] == "decode")
    old["spec"]["containers"][0]["env"].append({"name": "OLD_KNOB", "value": "1"})
    old["metadata"]["labels"]["pdfleet.io/revision"] = "0000000000"
    old["metadata"]["annotations"]["pdfleet.io/identity"] = "decode/0000000000/0"
    cm = copy.deepcopy(next(m for m in maps if "decode" in m["metadata"]["name"]))
    cm["metadata"]["name"] = cm["metadata"]["name"].replace(role_revision(spec, Role.DECODE), "0000000000")
    cm["data"]["runtime.yaml"] = cm["data"]["runtime.yaml"].replace("drainTimeoutSeconds: ", "drainTimeoutSeconds: 1")
    decode = next(d for d in role_diffs(NAME, NS, spec, live, [*maps, cm]) if d.role is Role.DECODE)
    assert decode.rolls and decode.sample == old["metadata"]["name"]
    paths = {c.path: c for c in decode.changes}
    assert paths["pod.spec.containers[runtime].env[OLD_KNOB]"].rendered == "<absent>"
    assert "configmap.data[runtime.yaml].drainTimeoutSeconds" in paths, decode.changes


def test_compare_reads_rendered_keys_and_named_items() -> None:
    rendered = {"a": 1, "l": [{"name": "x", "v": 1}], "s": [1, 2]}
    live = {"a": 1, "extra": True, "l": [{"name": "x", "v": 2, "d": 0}, {"name": "y"}], "s": [1, 3]}
    assert [str(c) for c in compare(rendered, live, "o")] == ["o.l[x].v: 2 -> 1", 'o.l[y]: {"name": "y"} -> <absent>',
                                                              "o.s[1]: 3 -> 2"]

"""spec.model.source reaches the built-in runtime's pods as it reaches SGLang's: the path in the runtime config
(the ranks compute that model), its volume mounted read-only there; a Hub source is SGLang's only."""

from __future__ import annotations

import copy

import pytest

from pdfleet_operator.api.constants import Role
from pdfleet_operator.api.models import PDDeploymentSpec
from pdfleet_operator.api.rules import CEL_RULES
from pdfleet_operator.resources.pods import runtime_pod
from pdfleet_operator.resources.runtime_config import runtime_config

BASE = {"model": {"layout": {"preset": "llama-dense"}},
        "transfer": {"backend": "mooncake"},
        "prefill": {"replicas": 1, "parallelism": {"tensor": 2}, "image": "ghcr.io/pdfleet/runtime:0.1.0"},
        "decode": {"replicas": 1, "parallelism": {"tensor": 2}, "image": "ghcr.io/pdfleet/runtime:0.1.0"}}
VOLUME = {"persistentVolumeClaim": {"claimName": "tiny-llama", "readOnly": True}}


def spec(**model: object) -> PDDeploymentSpec:
    raw = copy.deepcopy(BASE)
    raw["model"].update(model)  # type: ignore[union-attr]
    return PDDeploymentSpec.model_validate(raw)


@pytest.mark.parametrize("role", [Role.PREFILL, Role.DECODE])
def test_the_builtin_runtime_gets_the_model_path_and_its_volume(role: Role) -> None:
    s = spec(source={"path": "/models/tiny", "volume": VOLUME})
    cfg = runtime_config("tiny", "ns", s, role)
    assert cfg.model is not None and str(cfg.model.path) == "/models/tiny"
    pod = runtime_pod("tiny", "ns", s, role, "r1", 0)
    (container,) = pod["spec"]["containers"]
    assert {"name": "model", **VOLUME} in pod["spec"]["volumes"]
    assert {"name": "model", "mountPath": "/models/tiny", "readOnly": True} in container["volumeMounts"]


def test_without_a_source_the_runtime_fills_seeded_state() -> None:
    assert runtime_config("tiny", "ns", spec(), Role.PREFILL).model is None
    pod = runtime_pod("tiny", "ns", spec(), Role.PREFILL, "r1", 0)
    assert all(v["name"] != "model" for v in pod["spec"]["volumes"])


def test_an_sglang_pod_mounts_the_model_once_and_its_runtime_config_names_none() -> None:
    s = PDDeploymentSpec.model_validate({**copy.deepcopy(BASE), "engine": {
        "kind": "sglang", "version": "0.5.23", "image": "lmsysorg/sglang:v0.5.23"},
        "model": {"layout": {"preset": "llama-dense"}, "source": {"path": "/models/tiny", "volume": VOLUME}}})
    assert runtime_config("tiny", "ns", s, Role.DECODE).model is None  # the engine reads it, not the ranks
    pod = runtime_pod("tiny", "ns", s, Role.DECODE, "r1", 0)
    assert [v["name"] for v in pod["spec"]["volumes"]].count("model") == 1


def test_a_hub_source_is_refused_for_the_builtin_runtime() -> None:
    (rule,) = [r for r in CEL_RULES if r.id == "builtin-model-path"]
    hub = {"huggingFace": {"id": "meta-llama/Meta-Llama-3-8B"}}
    assert not rule.check({**copy.deepcopy(BASE), "model": {"layout": {"preset": "llama-dense"}, "source": hub}})
    assert rule.check({**copy.deepcopy(BASE), "engine": {"kind": "sglang"},
                       "model": {"layout": {"preset": "llama-dense"}, "source": hub}})
    assert rule.check(copy.deepcopy(BASE))


def test_the_model_survives_the_configmap(tmp_path) -> None:
    from pdfleet_runtime.config import load_config

    cfg = runtime_config("tiny", "ns", spec(source={"path": "/models/tiny", "volume": VOLUME}), Role.PREFILL)
    (tmp_path / "runtime.yaml").write_text(cfg.to_yaml())
    assert load_config(tmp_path / "runtime.yaml").model == cfg.model

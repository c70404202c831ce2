"""spec.model.source reaches the built-in runtime's pods as it reaches SGLang's: the path in the runtime config
(the ranks compute that model), its volume mounted read-only there; a Hub source at a commit through the node's
weights cache (``huggingFace.cache``), with its token as a file, and the same cache as an engine's Hub cache."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from pdfleet_operator.api.constants import Role
from pdfleet_operator.api.models import PDDeploymentSpec
from pdfleet_operator.api.rules import CEL_RULES
from pdfleet_operator.resources.engine import HUB_CACHE
from pdfleet_operator.resources.names import HUB_TOKEN_MOUNT, WEIGHTS_MOUNT
from pdfleet_operator.resources.pods import runtime_pod
from pdfleet_operator.resources.runtime_config import runtime_config
from pdfleet_runtime.model.hub_cache import snapshot_dir

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


COMMIT = "0123456789abcdef0123456789abcdef01234567"
CACHE = {"hostPath": {"path": "/var/lib/weights", "type": "DirectoryOrCreate"}}
HUB = {"id": "Org/Tiny", "revision": COMMIT, "cache": CACHE}


def test_a_hub_source_on_the_builtin_runtime_needs_a_revision_and_the_node_cache() -> None:
    (rule,) = [r for r in CEL_RULES if r.id == "builtin-hub-source"]

    def with_hub(hub: dict, engine: dict | None = None) -> dict:
        raw = {**copy.deepcopy(BASE), "model": {"layout": {"preset": "llama-dense"}, "source": {"huggingFace": hub}}}
        return {**raw, "engine": engine} if engine else raw

    assert rule.check(with_hub(HUB))
    for missing in ("revision", "cache"):
        assert not rule.check(with_hub({k: v for k, v in HUB.items() if k != missing})), missing
    assert rule.check(with_hub({"id": "Org/Tiny"}, {"kind": "sglang"}))  # an engine downloads on its own
    assert rule.check(copy.deepcopy(BASE))


@pytest.mark.parametrize("role", [Role.PREFILL, Role.DECODE])
def test_the_builtin_runtime_fetches_the_commit_into_the_node_cache_with_its_token_as_a_file(role: Role) -> None:
    s = spec(source={"huggingFace": {**HUB, "tokenSecret": "hub-token", "endpoint": "http://mirror.local:8080"}})
    cfg = runtime_config("tiny", "ns", s, role)
    assert cfg.model is not None and cfg.model.hub is not None
    assert cfg.model.path == snapshot_dir(Path(WEIGHTS_MOUNT), "Org/Tiny", COMMIT)
    hub = cfg.model.hub
    assert (hub.id, hub.commit, hub.endpoint, hub.cache) == ("Org/Tiny", COMMIT, "http://mirror.local:8080",
                                                             Path(WEIGHTS_MOUNT))
    assert hub.token_path is not None and hub.token_path.is_relative_to(HUB_TOKEN_MOUNT)
    pod = runtime_pod("tiny", "ns", s, role, "r1", 0)
    (container,) = pod["spec"]["containers"]
    assert {"name": "weights-cache", **CACHE} in pod["spec"]["volumes"]
    assert {"name": "weights-cache", "mountPath": WEIGHTS_MOUNT} in container["volumeMounts"]  # the first pod fills it
    (token,) = [v for v in pod["spec"]["volumes"] if v["name"] == "hub-token"]
    assert token["secret"]["secretName"] == "hub-token"
    assert token["secret"]["items"] == [{"key": "token", "path": hub.token_path.name}]
    assert {"name": "hub-token", "mountPath": HUB_TOKEN_MOUNT, "readOnly": True} in container["volumeMounts"]
    assert all("HF_TOKEN" not in str(e) for e in container["env"])  # a file, never the environment
    anon = runtime_config("tiny", "ns", spec(source={"huggingFace": HUB}), role).model
    assert anon is not None and anon.hub is not None
    assert (anon.hub.token_path, anon.hub.endpoint) == (None, "https://huggingface.co")
    assert "hub-token" not in str(runtime_pod("tiny", "ns", spec(source={"huggingFace": HUB}), role, "r1", 0))
    # Its server listens once the fill and the load are done: liveness waits behind a startup probe whose
    # budget (period x failures) is the engines' 30 minutes, not liveness's 60 s.
    start, live = container["startupProbe"], container["livenessProbe"]
    assert start["httpGet"] == live["httpGet"] == {"path": "/healthz", "port": container["ports"][0]["containerPort"]}
    assert start["periodSeconds"] * start["failureThreshold"] >= 1800 > live["periodSeconds"] * live["failureThreshold"]


def test_a_branch_is_never_rendered_for_the_builtin_runtime() -> None:
    s = spec(source={"huggingFace": {**HUB, "revision": "main"}})
    with pytest.raises(ValueError, match="not a commit"):
        runtime_config("tiny", "ns", s, Role.PREFILL)


def test_an_engine_pod_uses_the_node_cache_as_its_hub_cache_and_the_endpoint() -> None:
    s = PDDeploymentSpec.model_validate({**copy.deepcopy(BASE), "engine": {
        "kind": "sglang", "version": "0.5.23", "image": "lmsysorg/sglang:v0.5.23"},
        "model": {"layout": {"preset": "llama-dense"},
                  "source": {"huggingFace": {**HUB, "endpoint": "http://mirror.local:8080"}}}})
    assert runtime_config("tiny", "ns", s, Role.DECODE).model is None  # the engine downloads, not the ranks
    pod = runtime_pod("tiny", "ns", s, Role.DECODE, "r1", 0)
    assert [v for v in pod["spec"]["volumes"] if v["name"] == "weights-cache"] == [{"name": "weights-cache", **CACHE}]
    (engine,) = [c for c in pod["spec"]["containers"] if c["name"] == "engine"]
    assert {"name": "weights-cache", "mountPath": HUB_CACHE} in engine["volumeMounts"]
    env = {e["name"]: e.get("value") for e in engine["env"]}
    assert env["HF_ENDPOINT"] == "http://mirror.local:8080" and env["HF_HOME"] + "/hub" == HUB_CACHE
    bare = PDDeploymentSpec.model_validate({**s.model_dump(by_alias=True, exclude_none=True), "model": {
        "layout": {"preset": "llama-dense"}, "source": {"huggingFace": {"id": "Org/Tiny"}}}})
    bare_pod = runtime_pod("tiny", "ns", bare, Role.DECODE, "r1", 0)
    assert "weights-cache" not in str(bare_pod) and "HF_ENDPOINT" not in str(bare_pod)  # unchanged renderings


def test_the_model_survives_the_configmap(tmp_path) -> None:
    from pdfleet_runtime.config import load_config

    cfg = runtime_config("tiny", "ns", spec(source={"path": "/models/tiny", "volume": VOLUME}), Role.PREFILL)
    (tmp_path / "runtime.yaml").write_text(cfg.to_yaml())
    assert load_config(tmp_path / "runtime.yaml").model == cfg.model

"""Engines and routers as plug-ins: every kind has one, the two registries agree, and a plug-in's facts are
what the generic rendering reads (the worker port, the group port, the router default, the admin Secret)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdfleet_operator.api.constants import Role
from pdfleet_operator.api.models import EngineKind, PDDeploymentSpec, RouterKind
from pdfleet_operator.plan import Owner, Snapshot, desired_children, plan
from pdfleet_operator.resources.plugins.registry import (
    ENGINES,
    ROUTERS,
    engine_plugin,
    router_kind,
    router_plugin,
)
from pdfleet_operator.resources.router import worker_port
from pdfleet_operator.validation import validate_object
from pdfleet_runtime.engine_rules import checked_kinds, rules_of
from pdfleet_runtime.engine_rules.registry import ENGINES as RULES
from pdfleet_runtime.engine_rules.registry import PARALLEL_CELLS
from tests.unit.engine_rules.builders import sglang_obj, vllm_obj

REPO = Path(__file__).resolve().parents[3]


def _spec(obj: dict) -> PDDeploymentSpec:
    return PDDeploymentSpec.model_validate(obj["spec"])


def test_every_kind_has_a_plugin_and_the_registries_agree() -> None:
    assert set(ENGINES) == set(EngineKind)
    assert set(ROUTERS) == set(RouterKind)
    assert set(RULES) == {k.value for k in EngineKind}
    for kind, plugin in ENGINES.items():
        assert plugin.kind is kind and plugin.rules is rules_of(kind.value)
        assert RouterKind(plugin.rules.own_router) in ROUTERS
        assert (plugin.container is None) == (not plugin.rules.checked)  # the built-in runtime: nothing to check
    assert checked_kinds() == ("sglang", "vllm")
    assert PARALLEL_CELLS[0].engine == "pdfleet"  # the built-in runtime's cells first


@pytest.mark.parametrize("kind", [k for k in EngineKind if rules_of(k.value).checked])  # type: ignore[union-attr]
def test_check_harness_exists(kind: EngineKind) -> None:
    harness = ENGINES[kind].rules.harness
    assert harness is not None and (REPO / harness.tests).is_dir()
    assert f'"{harness.venv}"' in (REPO / "scripts" / "venvs.py").read_text()
    assert set(ENGINES[kind].rules.owned_flags) >= {"served_model_name", "host", "port"}


@pytest.mark.parametrize(("obj", "kind", "router", "port", "group"), [
    (sglang_obj(), EngineKind.SGLANG, RouterKind.SGLANG, 30000, ("dist-init", 5000)),
    (vllm_obj(), EngineKind.VLLM, RouterKind.VLLM, 30000, ("dist-init", 5000)),
    (sglang_obj(spec__engine=None, spec__model__source=None), EngineKind.PDFLEET, RouterKind.SGLANG, 8080,
     ("group", 8997)),
])
def test_generic_rendering_reads_the_plugin(obj: dict, kind: EngineKind, router: RouterKind, port: int,
                                            group: tuple[str, int]) -> None:
    obj["spec"]["router"] = {"image": "r:1"}
    spec = _spec(obj)
    plugin = engine_plugin(spec)
    assert plugin.kind is kind and router_kind(spec) is router and router_plugin(spec).kind is router
    assert worker_port(spec) == plugin.worker.port == port
    assert (plugin.group_port.name, plugin.group_port.port) == group
    bodies = [a.body for a in plan(Owner("qwen", "default", "uid"), spec, Snapshot()) if a.body is not None]
    secrets = [b for b in bodies if b["kind"] == "Secret" and b["metadata"]["name"] == "qwen-router-keys"]
    assert bool(secrets) == (router is RouterKind.SGLANG)  # only sglang-router has an admin API to lock
    pods = [b for b in bodies if b["kind"] == "Pod"]
    assert pods and all([c["name"] for c in p["spec"]["containers"]]
                        == (["runtime"] if plugin.container is None else ["engine", "runtime"]) for p in pods)
    router_pods = [o for o in desired_children(Owner("qwen", "default", "uid"), spec) if o["kind"] == "Deployment"]
    [deployment] = router_pods
    assert "router" in [c["name"] for c in deployment["spec"]["template"]["spec"]["containers"]]


def test_vllm_fleet_gets_no_sglang_message() -> None:
    """A vLLM fleet on a pair without a vLLM connector and with a per-GPU device map: vLLM's own reasons only
    (before the plug-ins, SGLang's per-GPU check ran on every engine and added an SGLang message)."""
    obj = vllm_obj(spec__transfer={"backend": "mori", "protocol": "rdma", "rdmaDeviceMap": {"0": ["mlx5_0"]}})
    messages = [v.message for v in validate_object(obj).violations if v.rule == "engine-protocol-unsupported"]
    assert messages and all(m.startswith("vllm") for m in messages), messages


def test_engine_command_through_the_plugin() -> None:
    spec = _spec(vllm_obj())
    container = engine_plugin(spec).container
    assert container is not None
    assert container.command("qwen", spec, Role.PREFILL, None)[:2] == ["vllm", "serve"]

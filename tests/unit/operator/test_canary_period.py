"""``spec.transfer.canaryPeriodSeconds`` reaches both runtimes (the built-in server and the engine agent) through the
role's ConfigMap; unset, nothing is written (a runtime that predates the field reads the config as before), and a
``--canary-period`` flag still wins."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from pydantic import ValidationError

from pdfleet_operator.api.constants import Role
from pdfleet_operator.api.models import PDDeploymentSpec
from pdfleet_operator.resources.revision import role_revision
from pdfleet_operator.resources.runtime_config import runtime_config
from pdfleet_runtime.agent.options import AgentOptions
from pdfleet_runtime.config import load_config
from pdfleet_runtime.pod.options import ServeOptions

BASE = {"model": {"layout": {"preset": "llama-dense"}},
        "transfer": {"backend": "mooncake"},
        "prefill": {"replicas": 1, "parallelism": {"tensor": 1}, "image": "ghcr.io/pdfleet/runtime:0.1.0"},
        "decode": {"replicas": 1, "parallelism": {"tensor": 1}, "image": "ghcr.io/pdfleet/runtime:0.1.0"}}


def spec(period: int | None) -> PDDeploymentSpec:
    raw = copy.deepcopy(BASE)
    if period is not None:
        raw["transfer"]["canaryPeriodSeconds"] = period  # type: ignore[index]
    return PDDeploymentSpec.model_validate(raw)


def test_the_period_reaches_the_server_and_the_agent_and_a_flag_wins(tmp_path: Path) -> None:
    path = tmp_path / "runtime.yaml"
    path.write_text(runtime_config("d", "ns", spec(3), Role.DECODE).to_yaml())
    cfg = load_config(path)
    assert "canaryPeriodSeconds: 3" in path.read_text()
    assert ServeOptions.build(cfg, {}).canary_period_s == 3
    assert ServeOptions.build(cfg, {}, canary_period_s=0.5).canary_period_s == 0.5
    assert AgentOptions.build(cfg, {}, engine_version="0.5.23").canary_period_s == 3
    assert AgentOptions.build(cfg, {}, engine_version="0.5.23", canary_period_s=7.0).canary_period_s == 7.0


def test_unset_writes_nothing_and_keeps_the_runtimes_default_and_the_revision(tmp_path: Path) -> None:
    text = runtime_config("d", "ns", spec(None), Role.DECODE).to_yaml()
    assert "canaryPeriod" not in text
    (tmp_path / "runtime.yaml").write_text(text)
    cfg = load_config(tmp_path / "runtime.yaml")
    assert ServeOptions.build(cfg, {}).canary_period_s == ServeOptions.canary_period_s == 10.0
    # unset renders what it rendered before the field existed; set, the pods roll to read it
    assert role_revision(spec(None), Role.DECODE) != role_revision(spec(3), Role.DECODE)


@pytest.mark.parametrize("period", [0, 3601])
def test_a_period_out_of_range_is_refused_naming_the_field(period: int) -> None:
    with pytest.raises(ValidationError, match=r"canaryPeriodSeconds|canary_period_seconds"):
        spec(period)

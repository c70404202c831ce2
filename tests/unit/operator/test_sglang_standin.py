"""The harness's stand-in for SGLang: a rendered ``sglang.launch_server`` command becomes a ``serve``
process whose runtime config carries the launch flags, beside a model directory generated from the layout."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from pdfleet_devcluster.standin import STANDIN_ADMIN_PORT, SGLangStandIn
from pdfleet_operator.api.constants import Role
from pdfleet_operator.api.models import PDDeploymentSpec
from pdfleet_operator.resources.pods import runtime_pod
from pdfleet_operator.resources.runtime_config import runtime_configmap
from pdfleet_runtime.agent.model_config import model_config_problems
from pdfleet_runtime.config import RuntimeConfig
from pdfleet_runtime.layouts import resolve_layout

SPEC = {
    "engine": {"kind": "sglang", "version": "0.5.23", "image": "lmsysorg/sglang:v0.5.23"},
    "model": {"layout": {"preset": "qwen3-next-hybrid"}, "servedName": "qn",
              "source": {"path": "/models/qn", "volume": {"emptyDir": {}}}},
    "transfer": {"backend": "nixl", "protocol": "tcp"},
    "prefill": {"replicas": 1, "parallelism": {"tensor": 2}, "image": "host"},
    "decode": {"replicas": 1, "parallelism": {"tensor": 1}, "image": "host",
               "pool": {"kvTokensPerReplica": 4096, "maxConcurrentRequests": 4}},
}


@dataclass
class Sandbox:  # what the stand-in reads of podsandbox.PodSandbox
    pod: dict
    workdir: Path

    def lookup(self, kind: str, name: str) -> dict[str, bytes] | None:
        spec = PDDeploymentSpec.model_validate(SPEC)
        cm = runtime_configmap("qn", "ns", spec, Role.DECODE, "r1")
        return {k: v.encode() for k, v in cm["data"].items()} if name == cm["metadata"]["name"] else None


def test_launch_flags_become_the_serve_config_and_the_model_dir_matches_the_layout(tmp_path: Path) -> None:
    spec = PDDeploymentSpec.model_validate(SPEC)
    pod = runtime_pod("qn", "ns", spec, Role.DECODE, "r1", 0)
    engine, agent = pod["spec"]["containers"]
    (tmp_path / "volumes" / "model").mkdir(parents=True)
    standin = SGLangStandIn(agent_args=("--canary-period", "3"), serve_args=("--room-ttl", "5"))
    box = Sandbox(pod, tmp_path)
    run = standin(box, engine)
    cmd = run["command"]
    assert cmd[:2] == ["pdfleet-runtime", "serve"] and cmd[-2:] == ["--room-ttl", "5"]
    assert cmd[cmd.index("--stand-in-for") + 1] == "sglang==0.5.23" and "--no-gate" in cmd
    assert run["lifecycle"] == engine["lifecycle"]  # the engine's preStop hook stays
    cfg = RuntimeConfig.model_validate(yaml.safe_load(Path(cmd[cmd.index("--config") + 1]).read_text()))
    assert (cfg.role.value, cfg.backend.value, cfg.shape.tp, cfg.peer_shape.tp) == ("decode", "nixl", 1, 2)
    assert (cfg.http_port, cfg.bootstrap_port, cfg.admin_port) == (30000, 8998, STANDIN_ADMIN_PORT)
    assert cfg.served_model_name == "qn" and cfg.kv_tokens == 4096
    written = json.loads((tmp_path / "volumes" / "model" / "config.json").read_text())
    assert written["architectures"] == ["Qwen3NextForCausalLM"]
    assert model_config_problems(written, resolve_layout("qwen3-next-hybrid")) == []
    assert standin(box, agent)["command"][-2:] == ["--canary-period", "3"]

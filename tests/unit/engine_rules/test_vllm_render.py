"""The vLLM pod: `vllm serve` per role, the transfer's environment, parallelism, replica groups, the router."""

from __future__ import annotations

import json

from pdfleet_operator.api.constants import Role
from pdfleet_operator.api.models import PDDeploymentSpec
from pdfleet_operator.render import render_object
from pdfleet_operator.resources.pods import runtime_pod
from pdfleet_operator.resources.router import router_command
from pdfleet_operator.validation import validate_object
from tests.unit.engine_rules.builders import vllm_obj


def spec_of(obj: dict) -> PDDeploymentSpec:
    verdict = validate_object(obj)
    assert verdict.violations == (), [(v.rule, v.message) for v in verdict.violations]
    return PDDeploymentSpec.model_validate(verdict.spec)


def engine(obj: dict, role: Role, member: int = 0) -> tuple[dict, dict]:
    pod = runtime_pod(obj["metadata"]["name"], "ns", spec_of(obj), role, "rev", 0, member)
    (container,) = [c for c in pod["spec"]["containers"] if c["name"] == "engine"]
    return pod, container


def test_nixl_roles() -> None:
    obj = vllm_obj(spec__engine__args=["--max-num-seqs", "64"], spec__decode__engine={"args": ["--enforce-eager"]})
    for role, kv_role in ((Role.PREFILL, "kv_producer"), (Role.DECODE, "kv_consumer")):
        pod, c = engine(obj, role)
        cmd = c["command"]
        assert cmd[:3] == ["vllm", "serve", "/models/qwen3-next"]
        kv = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
        assert kv == {"kv_connector": "NixlConnector", "kv_role": kv_role}
        assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2" and "--data-parallel-size" not in cmd
        assert cmd[cmd.index("--port") + 1] == "30000" and cmd[cmd.index("--host") + 1] == "0.0.0.0"
        assert cmd[-2:] == ["--max-num-seqs", "64"] if role is Role.PREFILL else cmd[-3:] == [
            "--max-num-seqs", "64", "--enforce-eager"]
        env = {e["name"]: e for e in c["env"]}
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"] == "5600"
        annotations = pod["metadata"]["annotations"]
        assert (annotations.get("vllm.ai/bootstrap-port") == "5600") == (role is Role.PREFILL)
        assert "sglang.ai/bootstrap-port" not in annotations


def test_the_agent_beside_vllm_speaks_vllm() -> None:
    """The agent is told the engine's kind, so it reads /version, /v1/models and vLLM's gauges and sends its
    canary as vllm-router does (agent/dialect.py), and the version it checks."""
    for role in Role:
        pod, _ = engine(vllm_obj(), role)
        (agent,) = [c for c in pod["spec"]["containers"] if c["name"] == "runtime"]
        cmd = agent["command"]
        assert cmd[:2] == ["pdfleet-runtime", "agent"]
        assert cmd[cmd.index("--engine-kind") + 1] == "vllm" and cmd[cmd.index("--engine-version") + 1] == "0.33.0"


def test_mooncake_extra_config_and_devices() -> None:
    obj = vllm_obj(spec__transfer={"backend": "mooncake", "rdmaDevices": ["mlx5_0", "mlx5_1"]})
    pod, c = engine(obj, Role.PREFILL)
    cmd = c["command"]
    kv = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert kv == {"kv_connector": "MooncakeConnector", "kv_role": "kv_producer",
                  "kv_connector_extra_config": {"mooncake_protocol": "rdma", "device_name": "mlx5_0,mlx5_1"}}
    env = {e["name"]: e for e in c["env"]}
    assert env["VLLM_MOONCAKE_BOOTSTRAP_PORT"]["value"] == "8998" and "VLLM_NIXL_SIDE_CHANNEL_HOST" not in env
    assert pod["metadata"]["annotations"]["vllm.ai/bootstrap-port"] == "8998"
    assert {"name": "bootstrap", "containerPort": 8998, "protocol": "TCP"} in c["ports"]
    tcp = vllm_obj(spec__transfer={"backend": "mooncake", "protocol": "tcp"})
    cmd = engine(tcp, Role.DECODE)[1]["command"]
    assert json.loads(cmd[cmd.index("--kv-transfer-config") + 1])["kv_connector_extra_config"] == {
        "mooncake_protocol": "tcp"}


def test_nixl_tcp_and_nvlink_env() -> None:
    env = {e["name"]: e.get("value") for e in engine(vllm_obj(spec__transfer={"backend": "nixl", "protocol": "tcp"}),
                                                      Role.DECODE)[1]["env"]}
    assert env["UCX_TLS"] == "tcp"
    pod, c = engine(vllm_obj(spec__transfer={"backend": "nixl", "protocol": "nvlink"}), Role.DECODE)
    assert {e["name"]: e.get("value") for e in c["env"]}["UCX_TLS"] == "cuda_ipc,cuda_copy,tcp"
    assert pod["spec"]["hostIPC"] is True
    devices = engine(vllm_obj(spec__transfer={"backend": "nixl", "rdmaDevices": ["mlx5_0", "mlx5_3"]}),
                     Role.PREFILL)[1]["env"]
    assert {"name": "UCX_NET_DEVICES", "value": "mlx5_0:1,mlx5_3:1"} in devices


def test_attention_dp_and_expert_parallel_map_to_vllm() -> None:
    obj = vllm_obj(spec__model__layout={"preset": "deepseek-mla"},
                   spec__prefill__parallelism={"tensor": 8, "data": 8, "expert": 8},
                   spec__decode__parallelism={"tensor": 8, "data": 2})
    _pod, c = engine(obj, Role.PREFILL)
    cmd = c["command"]
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "1"
    assert cmd[cmd.index("--data-parallel-size") + 1] == "8" and "--enable-expert-parallel" in cmd
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"  # DP x TP = pdfleet's tensor
    cmd = engine(obj, Role.DECODE)[1]["command"]
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "4" and cmd[cmd.index("--data-parallel-size") + 1] == "2"
    assert "--enable-expert-parallel" not in cmd


def test_replica_group_is_vllm_multi_node() -> None:
    obj = vllm_obj(spec__model__layout={"preset": "llama-dense"},
                   spec__prefill__parallelism={"tensor": 8, "pipeline": 2, "nodesPerReplica": 2})
    leader = engine(obj, Role.PREFILL, 0)[1]["command"]
    member = engine(obj, Role.PREFILL, 1)[1]["command"]
    for cmd, rank in ((leader, "0"), (member, "1")):
        assert cmd[cmd.index("--nnodes") + 1] == "2" and cmd[cmd.index("--node-rank") + 1] == rank
        assert cmd[cmd.index("--master-port") + 1] == "5000"
        # the group's first pod through the group's headless Service (published before it is Ready)
        assert cmd[cmd.index("--master-addr") + 1] == "qwen-vllm-prefill-rev-0.qwen-vllm-prefill-group.ns.svc"
    assert "--headless" not in leader and "--headless" in member


def test_render_prints_a_vllm_router() -> None:
    obj = vllm_obj(spec__router={"image": "vllm-router:0.1.17"})
    objs = render_object(obj).objects
    (dep,) = [o for o in objs if o["kind"] == "Deployment"]
    container, front = dep["spec"]["template"]["spec"]["containers"]
    cmd = container["command"]
    assert cmd[:2] == ["vllm-router", "--vllm-pd-disaggregation"]
    assert front["command"][:4] == ["pdfleet-runtime", "router-front", "--router", "vllm"]
    assert cmd[cmd.index("--kv-connector") + 1] == "nixl"
    # the key it sends workers (Authorization: Bearer $OPENAI_API_KEY), from the worker-key Secret
    assert container["env"] == [{"name": "OPENAI_API_KEY", "valueFrom": {"secretKeyRef": {
        "name": "qwen-vllm-worker-auth", "key": "key"}}}]
    role = next(o for o in objs if o["kind"] == "Role" and o["metadata"]["name"].endswith("-router"))
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    assert any(o["kind"] == "Service" and o["metadata"]["name"].endswith("router") for o in objs)
    assert not any(o["kind"] == "Secret" and "router" in o["metadata"]["name"] for o in objs)  # no admin key
    sglang = router_command("d", "ns", spec_of(vllm_obj(spec__router={"image": "x"})))
    assert sglang[0] == "vllm-router"  # the default router of a vLLM fleet

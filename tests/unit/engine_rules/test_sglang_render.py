"""The rendered SGLang pod (engine container, agent beside it) and `pdfleet render` (one code path with plan)."""

from __future__ import annotations

import json

import yaml

from pdfleet_operator import cli
from pdfleet_operator.api.constants import Role
from pdfleet_operator.api.models import PDDeploymentSpec
from pdfleet_operator.plan import Owner, Snapshot, plan
from pdfleet_operator.render import PLACEHOLDER_UID, render_object
from pdfleet_operator.resources.engine import group_member, group_service, launch_command
from pdfleet_operator.resources.pods import runtime_pod
from tests.unit.engine_rules.builders import sglang_obj


def pod(obj, role=Role.PREFILL) -> dict:
    return runtime_pod("qwen", "default", PDDeploymentSpec.model_validate(obj["spec"]), role, "r1", 0)


def containers(p: dict) -> dict[str, dict]:
    return {c["name"]: c for c in p["spec"]["containers"]}


def flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def env_of(c: dict) -> dict[str, object]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


def test_engine_container_runs_launch_server_with_full_flag_names() -> None:
    obj = sglang_obj(spec__engine__args=["--mem-fraction-static", "0.85"],
                     spec__prefill__engine={"args": ["--chunked-prefill-size", "8192"]},
                     spec__prefill__parallelism={"tensor": 4, "pipeline": 2})
    p = pod(obj)
    eng, agent = p["spec"]["containers"]
    assert eng["name"] == "engine" and agent["name"] == "runtime"
    cmd = eng["command"]
    assert cmd[:3] == ["python3", "-m", "sglang.launch_server"]
    assert flag(cmd, "--tp-size") == "4" and flag(cmd, "--pp-size") == "2"
    assert flag(cmd, "--disaggregation-mode") == "prefill"
    assert flag(cmd, "--disaggregation-transfer-backend") == "mooncake"
    assert flag(cmd, "--disaggregation-bootstrap-port") == "8998"
    assert flag(cmd, "--model-path") == "/models/qwen3.8-flash-next"
    assert flag(cmd, "--served-model-name") == "qwen3.8-flash-next"
    assert flag(cmd, "--host") == "0.0.0.0" and flag(cmd, "--port") == "30000" and "--enable-metrics" in cmd
    assert cmd[-4:] == ["--mem-fraction-static", "0.85", "--chunked-prefill-size", "8192"]  # shared, then role
    assert "--max-total-tokens" not in cmd  # the pool default leaves SGLang's own sizing
    assert "--tp" not in cmd and "--dp" not in cmd
    # the decode pod gets the shared args but not the prefill's
    dcmd = containers(pod(obj, Role.DECODE))["engine"]["command"]
    assert "--chunked-prefill-size" not in dcmd and flag(dcmd, "--disaggregation-mode") == "decode"
    assert flag(dcmd, "--disaggregation-bootstrap-port") == "8998"  # the same on both roles


def test_gpus_rdma_and_capabilities_belong_to_the_engine() -> None:
    obj = sglang_obj(spec__prefill__resources={"limits": {"cpu": "4", "memory": "8Gi"}})
    eng, agent = pod(obj)["spec"]["containers"]
    assert eng["resources"]["limits"] == {"nvidia.com/gpu": "2", "rdma/rdma_shared_device_a": "1"}
    assert eng["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    assert agent["resources"] == {"limits": {"cpu": "4", "memory": "8Gi"}}
    assert "add" not in agent["securityContext"]["capabilities"]
    assert agent["command"][:2] == ["pdfleet-runtime", "agent"]
    assert [p["name"] for p in agent["ports"]] == ["http"]  # the engine binds bootstrap and data ports


def test_pod_level_settings() -> None:
    p = pod(sglang_obj())
    spec = p["spec"]
    assert spec["readinessGates"] == [{"conditionType": "pdfleet.io/transfer-path"}]
    assert p["metadata"]["annotations"]["sglang.ai/bootstrap-port"] == "8998"
    assert "sglang.ai/bootstrap-port" not in pod(sglang_obj(), Role.DECODE)["metadata"]["annotations"]
    vols = {v["name"]: v for v in spec["volumes"]}
    assert vols["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert vols["model"] == {"name": "model", "persistentVolumeClaim": {"claimName": "models"}}
    eng = containers(p)["engine"]
    assert {"name": "model", "mountPath": "/models/qwen3.8-flash-next", "readOnly": True} in eng["volumeMounts"]
    assert eng["startupProbe"]["periodSeconds"] * eng["startupProbe"]["failureThreshold"] >= 1800
    assert "hostIPC" not in spec
    big = pod(sglang_obj(spec__prefill__parallelism={"tensor": 8}))
    assert {v["name"]: v for v in big["spec"]["volumes"]}["dshm"]["emptyDir"]["sizeLimit"] == "32Gi"


def test_protocol_table_renders_flags_and_env() -> None:
    tcp = containers(pod(sglang_obj(spec__transfer={"backend": "mooncake", "protocol": "tcp"})))["engine"]
    assert env_of(tcp)["MC_FORCE_TCP"] == "1" and "--disaggregation-ib-device" not in tcp["command"]
    assert "limits" in tcp["resources"] and "rdma/rdma_shared_device_a" not in tcp["resources"]["limits"]
    nv = pod(sglang_obj(spec__transfer={"backend": "nixl", "protocol": "nvlink"}))
    assert nv["spec"]["hostIPC"] is True
    assert env_of(containers(nv)["engine"])["UCX_TLS"] == "cuda_ipc,cuda_copy,tcp"
    listed = containers(pod(sglang_obj(spec__transfer={"backend": "mooncake", "rdmaDevices": ["mlx5_0", "mlx5_1"]})))
    assert flag(listed["engine"]["command"], "--disaggregation-ib-device") == "mlx5_0,mlx5_1"
    mapped = containers(pod(sglang_obj(spec__transfer={"backend": "mooncake",
                                                       "rdmaDeviceMap": {"1": ["mlx5_1"], "0": ["mlx5_0", "mlx5_2"]}})))
    ib = flag(mapped["engine"]["command"], "--disaggregation-ib-device")
    assert ib == '{"0":"mlx5_0,mlx5_2","1":"mlx5_1"}' and json.loads(ib) == {"0": "mlx5_0,mlx5_2", "1": "mlx5_1"}
    staged = containers(pod(sglang_obj(spec__engine__stagingBuffer=True)))["engine"]
    assert env_of(staged)["SGLANG_DISAGG_STAGING_BUFFER"] == "1"


def test_user_env_comes_after_the_table_and_hf_token_from_its_secret() -> None:
    obj = sglang_obj(spec__model__source={"huggingFace": {"id": "Qwen/Qwen3.8-Flash-Next", "tokenSecret": "hf"}},
                     spec__engine__env=[{"name": "MC_FORCE_TCP", "value": "0"}],
                     spec__decode__engine={"env": [{"name": "X", "value": "d"}]},
                     spec__transfer={"backend": "mooncake", "protocol": "tcp"})
    eng = containers(pod(obj, Role.DECODE))["engine"]
    names = [e["name"] for e in eng["env"]]
    assert names.index("MC_FORCE_TCP") < len(names) - 2 and names[-2:] == ["MC_FORCE_TCP", "X"]
    assert env_of(eng)["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    assert flag(eng["command"], "--model-path") == "Qwen/Qwen3.8-Flash-Next"


def test_max_total_tokens_from_a_given_pool_size() -> None:
    cmd = containers(pod(sglang_obj(spec__prefill__pool={"kvTokensPerReplica": 65536})))["engine"]["command"]
    assert flag(cmd, "--max-total-tokens") == "65536"


def test_pdfleet_engine_pods_keep_one_runtime_container() -> None:
    obj = sglang_obj(spec__engine=None, spec__model__source=None)
    (c,) = pod(obj)["spec"]["containers"]
    assert c["name"] == "runtime" and c["command"][:2] == ["pdfleet-runtime", "serve"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2"


def test_render_is_the_first_reconcile_pass() -> None:
    obj = sglang_obj()
    r = render_object(obj)
    assert r.verdict.admitted
    spec = PDDeploymentSpec.model_validate(r.verdict.spec)
    expected = [a.body for a in plan(Owner("qwen", "default", PLACEHOLDER_UID), spec, Snapshot()) if a.body]
    pods = [o for o in r.objects if o["kind"] == "Pod"]
    assert pods == [o for o in expected if o["kind"] == "Pod"] and len(pods) == 2
    assert [o["kind"] for o in r.objects] == [o["kind"] for o in expected]


def test_render_cli(tmp_path, capsys) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(sglang_obj()))
    assert cli.main(["render", "-f", str(good)]) == 0
    docs = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    assert {"Pod", "Service", "ConfigMap", "NetworkPolicy", "Role", "Secret"} <= {d["kind"] for d in docs}
    assert cli.main(["render", "-f", str(good), "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["kind"] == "List"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(sglang_obj(spec__engine__args=["--tp-size", "8"])))
    assert cli.main(["render", "-f", str(bad)]) == 1
    out = capsys.readouterr()
    assert out.out == "" and "engine-flag-owned" in out.err and "DENIED" in out.err


def test_render_and_validate_agree_on_every_example() -> None:
    from pathlib import Path

    from pdfleet_operator.render import render_text
    from pdfleet_operator.validation import validate_text

    examples = sorted((Path(__file__).resolve().parents[3] / "examples").rglob("*.yaml"))
    assert len(examples) > 40
    for path in examples:
        text = path.read_text()
        verdicts = validate_text(text, str(path))
        rendered = render_text(text, str(path))
        assert [v.admitted for v in verdicts] == [r.verdict.admitted for r in rendered], path
        assert [{x.rule for x in v.violations} for v in verdicts] == [
            {x.rule for x in r.verdict.violations} for r in rendered], path
        for r in rendered:
            assert bool(r.objects) is r.verdict.admitted, path


def test_docs_protocol_table_is_the_codes() -> None:
    from pathlib import Path

    from pdfleet_runtime.engine_rules.sglang import PROTOCOLS, RULES

    doc = (Path(__file__).resolve().parents[3] / "docs" / "sglang.md").read_text()
    for (backend, protocol), s in PROTOCOLS.items():
        row = f"| {protocol} | {backend} | {s.backend_flag} |"
        assert row in doc, row
        for k, v in s.env.items():
            assert f"{k}={v}" in doc
    for rule in RULES["0.5.23"]:
        assert f"`{rule.id}`" in doc and rule.source.removeprefix("python/sglang/srt/") in doc


def test_engine_changes_are_new_revisions() -> None:
    from pdfleet_operator.resources.revision import role_revision

    def revs(obj) -> tuple[str, str]:
        spec = PDDeploymentSpec.model_validate(obj["spec"])
        return role_revision(spec, Role.PREFILL), role_revision(spec, Role.DECODE)

    base = revs(sglang_obj())
    shared = revs(sglang_obj(spec__engine__args=["--mem-fraction-static", "0.8"]))
    assert shared[0] != base[0] and shared[1] != base[1]
    decode_only = revs(sglang_obj(spec__decode__engine={"image": "lmsysorg/sglang:v0.5.23-cu13"}))
    assert decode_only[0] == base[0] and decode_only[1] != base[1]  # a decode-only upgrade rolls decode only


def test_the_agent_knows_what_to_check_and_holds_the_pods_only_token() -> None:
    obj = sglang_obj(spec__model__source={"path": "/models/q", "volume": {"persistentVolumeClaim": {"claimName": "m"}}},
                     spec__decode__engine={"image": "lmsysorg/sglang:v0.5.23-cu13"})
    p = pod(obj, Role.DECODE)
    eng, agent = containers(p)["engine"], containers(p)["runtime"]
    cmd = agent["command"]
    assert cmd[:4] == ["pdfleet-runtime", "agent", "--config", "/etc/pdfleet/runtime.yaml"]
    assert flag(cmd, "--engine-version") == "0.5.23" and flag(cmd, "--model-path") == "/models/q"
    assert flag(cmd, "--engine-kind") == "sglang"
    assert flag(cmd, "--router-drop-seconds") == "6"  # ROUTER_DROP_BOUND_S, docs/router.md
    assert {"name": "model", "mountPath": "/models/q", "readOnly": True} in agent["volumeMounts"]
    # the engine's preStop waits for the agent's drain on the loopback admin port; both are exec hooks
    hook = eng["lifecycle"]["preStop"]["exec"]["command"]
    assert hook[:2] == ["python3", "-c"] and "http://127.0.0.1:8081/drain?wait=true" in hook[2]
    assert agent["lifecycle"]["preStop"]["exec"]["command"][:3] == ["pdfleet-runtime", "drain", "--wait"]
    # one API credential in the pod, the agent's
    assert p["spec"]["automountServiceAccountToken"] is False
    token = "/var/run/secrets/kubernetes.io/serviceaccount"
    assert [m["mountPath"] for m in agent["volumeMounts"]].count(token) == 1
    assert token not in [m["mountPath"] for m in eng["volumeMounts"]]
    (vol,) = [v for v in p["spec"]["volumes"] if v["name"] == "kube-api-access"]
    assert vol["projected"]["sources"][0]["serviceAccountToken"]["path"] == "token"
    # a Hub model: no path the agent can see, so no config.json check
    hub = sglang_obj(spec__model__source={"huggingFace": {"id": "Qwen/Qwen3.8-Flash-Next"}})
    assert "--model-path" not in containers(pod(hub, Role.DECODE))["runtime"]["command"]


def test_attention_dp_and_ep_render_inside_tp() -> None:
    obj = sglang_obj(spec__model__layout={"preset": "deepseek-mla"},
                     spec__prefill__parallelism={"tensor": 8, "data": 8, "expert": 8},
                     spec__decode__parallelism={"tensor": 8, "data": 4})
    cmd = containers(pod(obj))["engine"]["command"]
    assert flag(cmd, "--tp-size") == "8" and flag(cmd, "--attn-dp-size") == "8" and flag(cmd, "--ep-size") == "8"
    assert "--enable-dp-attention" not in cmd and "--dp-size" not in cmd  # deprecated / replicas, never rendered
    assert "--nnodes" not in cmd  # one node: no rendezvous flags
    dcmd = containers(pod(obj, Role.DECODE))["engine"]["command"]
    assert flag(dcmd, "--attn-dp-size") == "4" and "--ep-size" not in dcmd


def test_multi_node_replica_renders_rendezvous_per_pod_gpus_and_nccl() -> None:
    # nodesPerReplica > 1 is refused at admission (groups are not built); the rendering exists already
    obj = sglang_obj(spec__model__layout={"preset": "deepseek-mla"},
                     spec__transfer={"backend": "mooncake", "rdmaDeviceMap": {"0": ["mlx5_0"], "1": ["mlx5_1"]}},
                     spec__prefill__parallelism={"tensor": 16, "data": 16, "expert": 16, "nodesPerReplica": 2})
    p = pod(obj)
    eng = containers(p)["engine"]
    cmd = eng["command"]
    assert flag(cmd, "--nnodes") == "2" and flag(cmd, "--node-rank") == "0"
    assert flag(cmd, "--dist-init-addr") == "qwen-prefill-r1-0.qwen-prefill-group.default.svc:5000"
    assert eng["resources"]["limits"]["nvidia.com/gpu"] == "8"  # 16 GPUs over 2 nodes
    env = env_of(eng)
    assert env["NCCL_SOCKET_IFNAME"] == "eth0" and env["GLOO_SOCKET_IFNAME"] == "eth0"
    assert env["NCCL_IB_HCA"] == "mlx5_0,mlx5_1"
    spec = PDDeploymentSpec.model_validate(obj["spec"])
    member = group_member("qwen", "default", Role.PREFILL, "r1", 0, 1)
    assert flag(launch_command("qwen", spec, Role.PREFILL, member), "--node-rank") == "1"
    svc = group_service("qwen", "default", Role.PREFILL, {"pdfleet.io/deployment": "qwen"}, ("dist-init", 5000))
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["metadata"]["name"] == "qwen-prefill-group"

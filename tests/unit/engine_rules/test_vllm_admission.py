"""Admission of vLLM PDDeployments: owned flags seen through vLLM's parser forms, the rules, every violation."""

from __future__ import annotations

import pytest

from pdfleet_operator.validation import validate_object
from pdfleet_runtime.engine_rules import known_versions
from pdfleet_runtime.engine_rules.argv import flag_set
from pdfleet_runtime.engine_rules.vllm import RULES, vllm_parallel
from pdfleet_runtime.engine_rules.vllm_argv import read_vllm_args
from tests.unit.engine_rules.builders import vllm_obj


def violations(obj: dict) -> list[tuple[str, str, tuple[str, ...]]]:
    return [(v.rule, v.message, v.paths) for v in validate_object(obj).violations]


def rules(obj: dict) -> set[str]:
    return {r for r, _, _ in violations(obj)}


def test_base_spec_is_admitted_and_version_known() -> None:
    assert violations(vllm_obj()) == []
    assert known_versions("vllm") == ("0.33.0",)
    fs = flag_set("vllm", "0.33.0")
    assert fs is not None and len(fs.flags) == 483 and fs.abbrev
    assert len({f.dest for f in fs.flags.values()}) == 320


@pytest.mark.parametrize("args", [
    ["--tensor-parallel-size", "4"], ["--tensor-parallel-size=4"], ["-tp", "4"], ["--tensor-parallel", "4"],
    ["--tensor_parallel_size", "4"], ["--tensor_parallel=4"],
])
def test_owned_tp_through_every_form(args: list[str]) -> None:
    found = [(r, m, p) for r, m, p in violations(vllm_obj(spec__engine__args=args)) if r == "engine-flag-owned"]
    assert found and all(p == ("spec.engine.args[0]",) for _, _, p in found), found
    assert "parallelism.tensor" in found[0][1] and args[0].split("=")[0] in found[0][1]


@pytest.mark.parametrize(("args", "rule"), [
    (["--kv-transfer-config", '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'], "vllm.kv-transfer-config"),
    (["--kv-transfer-config.kv_role", "kv_both"], "vllm.kv-transfer-config"),
    (["--kv_transfer_config.kv_connector=LMCacheConnectorV1"], "vllm.kv-transfer-config"),
    (["--kv-offloading-size", "8"], "vllm.kv-offloading-size"),
    (["--kv_offloading_size=8"], "vllm.kv-offloading-size"),
    (["--kv-offloading-backend", "lmcache"], "vllm.kv-offloading-size"),
    (["--config", "serve.yaml"], "vllm.config-file"),
    (["--config=serve.yaml"], "vllm.config-file"),
    (["--model", "/other"], "engine-flag-owned"),
    (["--port", "8000"], "engine-flag-owned"),
    (["--data-parallel-size", "2"], "engine-flag-owned"),
    (["-dp", "2"], "engine-flag-owned"),
    (["--enable-expert-parallel"], "engine-flag-owned"),
    (["--headless"], "engine-flag-owned"),
    (["--no-such-flag"], "engine-flag-unknown"),
    (["--max-num-seqs"], "engine-flag-unknown"),  # needs a value
    (["--enable-return-routed-experts"], "vllm.routed-experts-pd"),
    (["-dcp", "2"], "vllm.dcp-nixl"),  # Qwen3-Next is not MLA
])
def test_flag_rules(args: list[str], rule: str) -> None:
    assert rule in rules(vllm_obj(spec__engine__args=args))


@pytest.mark.parametrize("args", [
    ["--max-num-seqs", "256"], ["--max_num_batched_tokens", "8192"], ["-O3"], ["-O", "2"], ["-O=1"],
    ["--compilation-config.cudagraph_mode", "FULL"], ["--enforce-eager"], ["--no-enable-prefix-caching"],
    ["--gpu-memory-utilization=0.85"], ["--max-model", "32768"],  # --max-model-len by abbreviation
])
def test_user_flags_stay_the_users(args: list[str]) -> None:
    assert violations(vllm_obj(spec__engine__args=args)) == []


def test_dotted_keys_fold_into_their_flag() -> None:
    fs = flag_set("vllm", "0.33.0")
    assert fs is not None
    read = read_vllm_args(["--max_num_seqs", "4", "--kv-transfer-config.kv_role", "kv_both",
                           "--kv-transfer-config.kv_connector_extra_config.backends+", "UCX,LIBFABRIC", "-O3"], fs)
    assert read.parsed.problems == ()
    assert read.parsed.values["max_num_seqs"] == "4" and read.parsed.values["optimization_level"] == "3"
    assert read.parsed.values["kv_transfer_config"] == (
        '{"kv_role": "kv_both", "kv_connector_extra_config": {"backends": ["UCX", "LIBFABRIC"]}}')
    assert read.origin[read.parsed.where["kv_transfer_config"][0]] == 2  # the first dotted key's element


def test_env_rules() -> None:
    env = [{"name": "PYTORCH_CUDA_ALLOC_CONF", "value": "expandable_segments:True"},
           {"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", "value": "10.0.0.1"}]
    found = violations(vllm_obj(spec__decode__engine={"env": env}))
    by_rule = {r: (m, p) for r, m, p in found}
    assert by_rule["vllm.expandable-segments"][1] == ("spec.decode.engine.env[0]",)
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in by_rule["vllm.expandable-segments"][0]
    assert by_rule["vllm.env-owned"][1] == ("spec.decode.engine.env[1]",)
    assert "VLLM_NIXL_SIDE_CHANNEL_HOST=10.0.0.1" in by_rule["vllm.env-owned"][0]
    # the cumem allocator keeps KV pages stable: vLLM accepts the variable then
    ok = vllm_obj(spec__engine__args=["--enable-cumem-allocator"], spec__decode__engine={"env": env[:1]})
    assert "vllm.expandable-segments" not in rules(ok)


def test_sleep_mode_with_mooncake() -> None:
    base = {"spec__transfer": {"backend": "mooncake", "protocol": "tcp"},
            "spec__engine__args": ["--enable-sleep-mode"]}
    assert "vllm.sleep-mode-mooncake" in rules(vllm_obj(**base))
    rdma = {**base, "spec__transfer": {"backend": "mooncake"}}
    assert "vllm.sleep-mode-mooncake" not in rules(vllm_obj(**rdma))
    nvl = vllm_obj(**rdma, spec__engine__env=[{"name": "MC_INTRANODE_NVLINK", "value": "0"}])
    assert "vllm.sleep-mode-mooncake" in rules(nvl)  # vLLM checks the variable is set, whatever its value


def test_pair_rules_name_both_roles() -> None:
    obj = vllm_obj(spec__decode__engine={"args": ["--dtype", "float16", "--kv-cache-dtype", "fp8"]},
                   spec__prefill__engine={"version": "0.34.0"})
    found = [(r, m, p) for r, m, p in violations(obj)]
    msgs = [m for r, m, _ in found if r == "vllm.nixl-compat-hash"]
    assert any("dtype differs" in m and "decode --dtype float16" in m for m in msgs), msgs
    assert any("kv-cache-dtype differs" in m and "--kv-cache-dtype fp8" in m for m in msgs), msgs
    assert any("version differs" in m for m in msgs), msgs
    assert "engine-version-unknown" in {r for r, _, _ in found}
    # the same flags on both roles keep the hash equal
    same = vllm_obj(spec__engine__args=["--dtype", "float16", "--kv-cache-dtype", "fp8"])
    assert "vllm.nixl-compat-hash" not in rules(same)
    # Mooncake has no compatibility hash: the pair rule is NIXL's
    moon = vllm_obj(spec__transfer={"backend": "mooncake"}, spec__decode__engine={"args": ["--dtype", "float16"]})
    assert "vllm.nixl-compat-hash" not in rules(moon)


def test_every_violation_is_reported() -> None:
    obj = vllm_obj(spec__engine__args=["--kv-offloading-size", "4", "--config", "x.yaml", "-tp", "2",
                                       "--no-such", "--enable-return-routed-experts"],
                   spec__decode__engine={"args": ["--dtype", "half"],
                                         "env": [{"name": "PYTORCH_CUDA_ALLOC_CONF",
                                                  "value": "expandable_segments:True"}]},
                   spec__decode__parallelism={"tensor": 2, "pipeline": 2},
                   spec__router={"image": "r", "kind": "sglang"})
    assert rules(obj) >= {"vllm.kv-offloading-size", "vllm.config-file", "engine-flag-owned", "engine-flag-unknown",
                          "vllm.routed-experts-pd", "vllm.expandable-segments", "vllm.nixl-compat-hash",
                          "vllm.nixl-pp-decode", "vllm.nixl-pp-hybrid", "router-kind-engine"}


def test_shape_rules() -> None:
    assert "vllm.world-size-node" in rules(vllm_obj(spec__prefill__parallelism={"tensor": 16}))
    # DP takes GPUs out of TP: tensor 16 with data 2 is vLLM TP 8, within the node
    assert "vllm.world-size-node" not in rules(vllm_obj(spec__model__layout={"preset": "deepseek-mla"},
                                                        spec__prefill__parallelism={"tensor": 16, "data": 2},
                                                        spec__decode__parallelism={"tensor": 16, "data": 2}))
    assert "vllm.expert-dense" in rules(vllm_obj(spec__model__layout={"preset": "llama-dense"},
                                                 spec__prefill__parallelism={"tensor": 2, "expert": 2}))
    assert "vllm.expert-mapping" in rules(vllm_obj(spec__model__layout={"preset": "deepseek-mla"},
                                                   spec__prefill__parallelism={"tensor": 4, "expert": 2}))
    assert "vllm.multi-node-dp" in rules(vllm_obj(spec__model__layout={"preset": "deepseek-mla"},
                                                  spec__prefill__parallelism={"tensor": 16, "data": 16,
                                                                              "expert": 16, "nodesPerReplica": 2}))
    het = vllm_obj(spec__model__layout={"preset": "llama-dense"}, spec__prefill__parallelism={"tensor": 8},
                   spec__decode__parallelism={"tensor": 4})
    assert "vllm.nixl-hetero-tp" not in rules(het)  # prefill TP 8 = the 8 KV heads: nothing replicated
    assert vllm_parallel(8, 8, 8) == (1, 8, True) and vllm_parallel(8, 2, 1) == (4, 2, False)
    assert vllm_parallel(8, 1, 4) is None


def test_protocols() -> None:
    assert "engine-protocol-unsupported" in rules(vllm_obj(spec__transfer={"backend": "mori"}))
    assert "engine-protocol-unsupported" in rules(vllm_obj(spec__transfer={"backend": "mooncake",
                                                                           "protocol": "nvlink"}))
    assert "engine-protocol-unsupported" in rules(vllm_obj(spec__transfer={"backend": "nixl",
                                                                           "rdmaDeviceMap": {"0": ["mlx5_0"]}}))


def test_every_rule_has_a_source_and_how_it_was_confirmed() -> None:
    for r in RULES["0.33.0"]:
        assert r.source and r.when in {"config", "silent", "gpu-worker", "pair"} and r.confirmed in {"run", "read"}

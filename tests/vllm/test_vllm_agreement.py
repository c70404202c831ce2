"""pdfleet's vLLM rules against vLLM 0.33.0 itself: the agreement table.

Every vLLM example and a seeded set of generated vLLM PDDeployments (both roles, both connectors, TP/PP/DP/EP,
hybrid, MLA and dense models) are rendered; each role's `vllm serve` command and environment runs through
vLLM's parser, serve's checks, ``create_engine_config`` and the scheduler-side connector on a faked H200
(tests/vllm/check_vllm.py). A role counts as rejected by vLLM when vLLM refuses it, or when vLLM accepts it
and PD is gone (the connector vLLM built is not the rendered one: ``--kv-offloading-size``). The test fails
when pdfleet admits a role vLLM rejects, when a vLLM rejection maps to no row, and when pdfleet denies a role
vLLM accepts with a rule that is not a documented silent, GPU-worker, pair or ownership rule. For NIXL specs
both roles start, the compatibility hashes vLLM computes are compared: they differ exactly when pdfleet's
pair rule fires. Positive controls run first.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml

from pdfleet_operator.api.constants import Role
from pdfleet_operator.api.models import PDDeploymentSpec
from pdfleet_operator.engine import engine_input
from pdfleet_operator.validation import validate_object
from pdfleet_runtime.engine_rules import evaluate_engine
from pdfleet_runtime.engine_rules.vllm import CONNECTORS, MODEL_FAMILIES, RULES, vllm_parallel
from tests.unit.engine_rules.builders import vllm_obj
from tests.vllm.cases import generated_specs, role_case
from tests.vllm.harness import REPO, run_cases, vllm_python
from tests.vllm.model_configs import write_model_dirs

pytestmark = pytest.mark.slow

GENERATED = 120
# (vLLM's check, what its rejection says, the pdfleet rule that denies the same role)
ROWS: tuple[tuple[str, str, str], ...] = (
    ("argparse (utils/argparse_utils.py)", r"^exit 2: .*(unrecognized arguments|invalid choice|expected one)",
     "engine-flag-unknown"),
    ("config/parallel.py:1068", r"World size \(\d+\) is larger than the number of available GPUs",
     "vllm.world-size-node"),
    ("config/model.py", r"Number of experts in the model must be greater than 0", "vllm.expert-dense"),
    ("config/parallel.py:600, config/model.py:1578", r"must be divisible by dcp_size|Decode context parallelism "
     r"for GQA/MQA|decode-context-parallel-size` \(\d+\) exceeds", "vllm.dcp-shape"),
    ("config/vllm.py:1572", r"decode_context_parallel_size", "vllm.dcp-nixl"),
    ("config/vllm.py", r"--enable-return-routed-experts|AuxOutput Connector", "vllm.routed-experts-pd"),
    ("config/vllm.py", r"expandable_segments", "vllm.expandable-segments"),
    ("config/vllm.py (supports_sleep_mode)", r"does not support sleep mode", "vllm.sleep-mode-mooncake"),
    ("config/kv_transfer.py (a user's kv-transfer-config)", r"Connector name is not set in KVTransferConfig",
     "vllm.kv-transfer-config"),
    ("config/vllm.py (silent: connector replaced)",
     r"^silent: connector (OffloadingConnector|SimpleCPUOffloadConnector|LMCacheMPConnector)",
     "vllm.kv-offloading-size"),
    ("config/vllm.py (silent: hybrid model, HMA off)", r"^silent: .*hybrid model without HMA",
     "vllm.hybrid-connector"),
    ("config/kv_transfer.py (silent: another connector)", r"^silent: connector \w+", "vllm.kv-transfer-config"),
)
STARTS = {"pair", "gpu-worker", "silent"}  # rules whose roles start in vLLM: denied for a documented reason
OWNERSHIP = {"engine-flag-owned", "vllm.config-file", "vllm.env-owned", "vllm.kv-transfer-config",
             "vllm.expert-mapping", "vllm.multi-node-dp", "engine-protocol-unsupported", "router-kind-engine",
             "vllm-router-mooncake-discovery"}  # the router's defect: the engine starts, the pair never forms
DOCUMENTED = {r.id for r in RULES["0.33.0"] if r.when in STARTS} | OWNERSHIP


def pdfleet_denials(obj: dict, role: Role) -> set[str]:
    verdict = validate_object(obj)
    spec = PDDeploymentSpec.model_validate(verdict.spec)
    inp = engine_input(spec)
    assert inp is not None
    errors, _ = evaluate_engine(dataclasses.replace(inp, roles=(role.value,)))
    shape = {v.rule for v in verdict.violations if v.rule in ("nodes-divide-gpus", "attn-dp-divides-tp")
             and any(p.startswith(f"spec.{role.value}.") for p in v.paths)}
    return {v.rule for v in errors} | shape


def vllm_verdict(result: dict, backend: str) -> str | None:
    """The row of vLLM's rejection (or of PD silently lost); None when the role starts with PD intact."""
    if result["ok"]:
        lost = result.get("connector") != CONNECTORS_BY_NAME[backend]
        no_hma = result.get("hybrid") and not result.get("hma")  # fails at start (kv_cache_planning.py:814)
        if not lost and not no_hma:
            return None
        text = f"silent: {'hybrid model without HMA, ' if no_hma else ''}connector {result.get('connector')}"
    else:
        text = f"{result['message']} @ {result.get('where', '')}"
    for _, pattern, rule in ROWS:
        if re.search(pattern, text):
            return rule
    return f"unmapped: {result.get('type')}: {text[:300]}"


CONNECTORS_BY_NAME = {str(b): c for b, c in CONNECTORS.items()}


def example_specs() -> list[tuple[str, dict]]:
    out = []
    for path in sorted((REPO / "examples").rglob("*.yaml")):
        try:
            docs = list(yaml.safe_load_all(path.read_text()))
        except yaml.YAMLError:
            continue
        for i, doc in enumerate(d for d in docs if isinstance(d, dict)):
            if doc.get("kind") == "PDDeployment" and (doc.get("spec", {}).get("engine") or {}).get("kind") == "vllm":
                out.append((f"{path.relative_to(REPO)}#{i}", doc))
    return out


CONTROLS = {
    # vLLM accepts the base spec on both roles, with the rendered connector and roles ...
    "control/ok": vllm_obj(),
    # ... refuses TP 16 on one node (its world-size check runs against the fake H200's 8 GPUs) ...
    "control/world-size": vllm_obj(spec__prefill__parallelism={"tensor": 16}),
    # ... refuses expandable segments with a connector (the pod's environment reaches the check) ...
    "control/expandable": vllm_obj(spec__engine__env=[{"name": "PYTORCH_CUDA_ALLOC_CONF",
                                                       "value": "expandable_segments:True"}]),
    # ... and silently swaps the connector for --kv-offloading-size (kserve #5987's failure mode)
    "control/offloading": vllm_obj(spec__engine__args=["--kv-offloading-size", "4"]),
    # named regressions: the other ways to lose the connector
    # ExampleConnector ships with vLLM and has no hybrid-cache support: on Qwen3-Next vLLM turns HMA off
    "regression/hybrid-connector": vllm_obj(spec__decode__engine={"args": [
        "--kv-transfer-config", '{"kv_connector":"ExampleConnector","kv_role":"kv_both"}']}),
    "regression/connector-override": vllm_obj(spec__model__layout={"preset": "llama-dense"}, spec__engine__args=[
        "--kv-transfer-config", '{"kv_connector":"ExampleConnector","kv_role":"kv_both"}']),
    # sleep mode with Mooncake over tcp, and with an NVLink variable set: refused by vLLM
    "control/sleep-mooncake-tcp": vllm_obj(spec__transfer={"backend": "mooncake", "protocol": "tcp"},
                                           spec__engine__args=["--enable-sleep-mode"]),
    "control/sleep-mooncake-nvlink-env": vllm_obj(spec__transfer={"backend": "mooncake"},
                                                  spec__engine__args=["--enable-sleep-mode"],
                                                  spec__engine__env=[{"name": "MC_INTRANODE_NVLINK", "value": "1"}]),
    "control/sleep-mooncake-rdma": vllm_obj(spec__transfer={"backend": "mooncake"},
                                            spec__engine__args=["--enable-sleep-mode"]),
    # replicas across nodes: vLLM's multi-node start (the first member serves, the others run headless)
    "multinode/llama-tp8-pp2": vllm_obj(spec__model__layout={"preset": "llama-dense"},
                                        spec__prefill__parallelism={"tensor": 8, "pipeline": 2, "nodesPerReplica": 2},
                                        spec__decode__parallelism={"tensor": 8}),
    "multinode/deepseek-tp16": vllm_obj(spec__model__layout={"preset": "deepseek-mla"},
                                        spec__prefill__parallelism={"tensor": 16, "nodesPerReplica": 2},
                                        spec__decode__parallelism={"tensor": 16, "nodesPerReplica": 2}),
    "regression/dotted-role": vllm_obj(spec__engine__args=["--kv-transfer-config.kv_role", "kv_both"]),
    "regression/decode-only-dtype": vllm_obj(spec__decode__engine={"args": ["--dtype", "float16"]}),
}


@pytest.fixture(scope="module")
def checked(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("vllm")
    dirs = write_model_dirs(tmp / "models")
    home = tmp / "home"
    home.mkdir()
    specs = list(CONTROLS.items()) + example_specs()
    specs += [(o["metadata"]["name"], o) for o in generated_specs(GENERATED)]
    cases, index, seen = [], [], {}
    for name, obj in specs:
        v = validate_object(obj)
        if v.spec is None or any(x.rule in ("engine-protocol-unsupported", "vllm.expert-mapping",
                                            "attn-dp-divides-tp") for x in v.violations):
            index.append((name, obj, None, None))  # no command is rendered for it: admission only
            continue
        for role in Role:
            nodes = obj["spec"][role.value]["parallelism"].get("nodesPerReplica", 1)
            for rank in sorted({0, nodes - 1}):
                case = role_case(obj, role, dirs, home, rank)
                key = json.dumps(case, sort_keys=True)
                if key not in seen:
                    seen[key] = f"{name}/{role.value}" + (f"/rank{rank}" if nodes > 1 else "")
                    cases.append({"id": seen[key], **case})
                index.append((name, obj, role, seen[key]))
    t0 = time.monotonic()
    out = run_cases(cases)
    out["wall_s"] = round(time.monotonic() - t0, 1)
    out["index"] = index
    out["examples"] = sum(1 for n, _ in specs if n.startswith("examples/"))
    if os.environ.get("PDFLEET_VLLM_RESULTS"):  # vLLM's answers per case, for reading after a run
        Path(os.environ["PDFLEET_VLLM_RESULTS"]).write_text(json.dumps(
            {"cases": cases, "results": out["results"]}, indent=1))
    return out


def _by_role(checked: dict) -> dict:
    return {(name, role): checked["results"][case] for name, _, role, case in checked["index"] if role}


def test_multi_node_members_start(checked) -> None:
    """Each replica group's first member starts vLLM's API server, the last runs headless, and vLLM's
    config takes the group's TP x PP across nodes (no world-size refusal: --nnodes is given)."""
    members = [(name, case) for name, _, role, case in checked["index"] if name.startswith("multinode/") and role]
    assert len({c for _, c in members}) >= 5, members
    for _, case in members:
        r = checked["results"][case]
        assert r["ok"], (case, r)
        assert r["launcher"] == ("headless" if case.endswith("/rank1") else "api_server"), (case, r)


def test_positive_controls_first(checked) -> None:
    r = _by_role(checked)
    for role in Role:
        ok = r["control/ok", role]
        assert ok["ok"] and ok["connector"] == "NixlConnector" and ok["connector_class"] == "NixlPullConnector", ok
        assert ok["kv_role"] == {"prefill": "kv_producer", "decode": "kv_consumer"}[role.value], ok
    bad = r["control/world-size", Role.PREFILL]
    assert not bad["ok"] and "World size (16)" in bad["message"], bad
    bad = r["control/expandable", Role.DECODE]
    assert not bad["ok"] and "expandable_segments" in bad["message"], bad
    assert r["control/sleep-mooncake-rdma", Role.PREFILL]["ok"], r["control/sleep-mooncake-rdma", Role.PREFILL]
    for name in ("control/sleep-mooncake-tcp", "control/sleep-mooncake-nvlink-env"):
        bad = r[name, Role.PREFILL]
        assert not bad["ok"] and "does not support sleep mode" in bad["message"], (name, bad)
    silent = r["control/offloading", Role.DECODE]
    assert silent["ok"] and silent["connector"] == "OffloadingConnector" and silent["kv_role"] == "kv_both", silent
    for name in ("control/world-size", "control/expandable", "control/offloading"):
        assert any(vllm_verdict(r[name, role], "nixl") for role in Role), name


def test_pdfleet_and_vllm_agree(checked) -> None:
    res = checked["results"]
    vllm_hits: Counter[str] = Counter()
    pdfleet_hits: Counter[str] = Counter()
    starts_denied: Counter[str] = Counter()
    disagreements = []
    roles_checked = mapped = 0
    for name, obj, role, case_id in checked["index"]:
        if role is None:
            continue
        roles_checked += 1
        backend = obj["spec"]["transfer"]["backend"]
        verdict = vllm_verdict(res[case_id], backend)
        ours = pdfleet_denials(obj, role)
        for rule in ours:
            pdfleet_hits[rule] += 1
        if res[case_id]["ok"]:  # vLLM's own config resolves pdfleet's mapping and model facts
            p = obj["spec"][role.value]["parallelism"]
            want = vllm_parallel(p["tensor"], p.get("data", 1), p.get("expert", 1))
            got = (res[case_id]["tp"], res[case_id]["dp"], res[case_id]["ep"])
            if want != got:
                disagreements.append(f"{name}/{role.value}: vLLM resolved TP/DP/EP {got}, pdfleet maps {want}")
            family = MODEL_FAMILIES[obj["spec"]["model"]["layout"]["preset"]]
            if res[case_id]["hybrid"] != family.hybrid:
                disagreements.append(f"{name}/{role.value}: vLLM hybrid={res[case_id]['hybrid']}, pdfleet "
                                     f"{family.hybrid}")
            mapped += 1
        if verdict is None:
            undocumented = ours - DOCUMENTED
            if undocumented:
                disagreements.append(f"{name}/{role.value}: vLLM starts it, pdfleet denies {sorted(undocumented)}")
            for rule in ours:
                starts_denied[rule] += 1
            continue
        vllm_hits[verdict] += 1
        if verdict.startswith("unmapped"):
            disagreements.append(f"{name}/{role.value}: vLLM rejection with no row: {verdict}")
        elif verdict not in ours:
            disagreements.append(f"{name}/{role.value}: vLLM rejects ({verdict}), pdfleet {sorted(ours) or 'admits'}")
    table = "\n".join(f"  {src:<46} {rule:<28} vllm={vllm_hits[rule]:<4} pdfleet={pdfleet_hits[rule]}"
                      for src, _, rule in ROWS)
    extra = "\n".join(f"  {rule:<34} denied, vLLM starts the role: {n}" for rule, n in sorted(starts_denied.items()))
    admitted_only = sum(1 for _, _, role, _ in checked["index"] if role is None)
    summary = (f"{mapped} roles' TP/DP/EP and hybrid flag read back from vLLM's config; {admitted_only} specs "
               f"denied for a shape or transfer with no vLLM form (no command rendered)\n"
               f"{roles_checked} role checks ({len(res)} distinct) from {checked['examples']} examples, "
               f"{GENERATED} generated specs and {len(CONTROLS)} controls/regressions; vLLM import+warm-up "
               f"{checked['import_s']} s, cases {checked['cases_s']} s, wall {checked['wall_s']} s\n{table}\n{extra}")
    print(summary)
    assert not disagreements, "\n".join(disagreements[:40]) + "\n" + summary
    empty = [rule for _, _, rule in ROWS if not vllm_hits[rule]]
    assert not empty, f"rows with zero vLLM hits: {empty}\n{summary}"


def test_nixl_pair_hash_agrees(checked) -> None:
    """Where both roles of a NIXL spec start, vLLM's compatibility hashes differ exactly when pdfleet's
    pair rule fires."""
    res = checked["results"]
    roles: dict[str, dict] = {}
    for name, obj, role, case_id in checked["index"]:
        if role is not None and obj["spec"]["transfer"]["backend"] == "nixl":
            roles.setdefault(name, {"obj": obj})[role] = res[case_id]
    compared = differing = 0
    for name, r in roles.items():
        p, d = r.get(Role.PREFILL), r.get(Role.DECODE)
        if not (p and d and p["ok"] and d["ok"] and "nixl_hash" in p and "nixl_hash" in d):
            continue
        compared += 1
        differ = p["nixl_hash"] != d["nixl_hash"]
        differing += differ
        fired = "vllm.nixl-compat-hash" in pdfleet_denials(r["obj"], Role.DECODE)
        assert differ == fired, (name, differ, fired)
    print(f"NIXL pairs compared: {compared}, hashes differing: {differing}")
    assert compared >= 10 and differing >= 1, (compared, differing)


def test_committed_flag_set_is_the_parsers() -> None:
    proc = subprocess.run([vllm_python(), str(REPO / "scripts" / "vllm" / "flagset.py")],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    committed = REPO / "runtime" / "pdfleet_runtime" / "engine_rules" / "vllm-0.33.0.flags.json"
    assert json.loads(proc.stdout) == json.loads(committed.read_text()), (
        "the committed flag set differs from vLLM's parser: regenerate it with scripts/vllm/flagset.py")

"""pdfleet's SGLang rules against SGLang 0.5.23 itself: its parser and start-up hooks, on rendered pods.

Every example, a few hundred generated SGLang PDDeployments (some with attention DP and EP) and the
multi-node specs of ``cases.MULTI_NODE`` (each group's first and last member) are rendered; each role's engine
command and environment run through SGLang (tests/sglang/check_server_args.py, forked per case,
``/sys/class/infiniband`` faked in a private mount namespace). ``ROWS`` maps every SGLang start-up
check a PDDeployment can reach to the pdfleet rule that denies it. The test fails on any
disagreement (SGLang rejects what pdfleet admits, or the reverse, or a different check), and on a
row with zero hits in either direction. Positive controls run first.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import time

import pytest
import yaml

from pdfleet_operator.api.constants import Role
from pdfleet_operator.api.models import PDDeploymentSpec
from pdfleet_operator.api.rules import CEL_RULES
from pdfleet_operator.engine import engine_input
from pdfleet_operator.validation import validate_object
from pdfleet_runtime.engine_rules import evaluate_engine
from pdfleet_runtime.engine_rules.sglang import MODEL_FAMILIES, PROTOCOLS, RULES
from tests.sglang.cases import MULTI_NODE, generated_specs, multi_node_specs, role_case
from tests.sglang.harness import REPO, run_cases, sglang_python
from tests.sglang.model_configs import write_model_dirs
from tests.unit.engine_rules.builders import sglang_obj

pytestmark = pytest.mark.slow

GENERATED = 250
# (SGLang file, what its rejection says, the pdfleet rule that denies the same spec)
ROWS: tuple[tuple[str, str, str], ...] = (
    ("argparse (server_args.py)", r"^exit 2: .*(unrecognized arguments|invalid choice|expected one argument)",
     "engine-flag-unknown"),
    ("model_overrides/qwen4_exp.py", r"Qwen4-Exp PD with MORI requires --pp-size 1", "sglang.qwen4-exp-mori-pp"),
    ("model_overrides/qwen4_exp.py", r"Qwen4-Exp does not support --enable-unified-memory",
     "sglang.qwen4-exp-unified-memory"),
    ("kv_cache_hook.py", r"--enable-unified-memory with PD disaggregation", "sglang.unified-memory-pd"),
    ("pd_disaggregation_hook.py", r"prefill_complete does not yet support", "sglang.prefill-complete-allocation"),
    ("pd_disaggregation_hook.py", r"SGLANG_DISAGG_STAGING_BUFFER requires", "sglang.staging-buffer-backend"),
    ("pd_disaggregation_hook.py", r"--enable-pd-role-switch does not rebuild", "sglang.role-switch"),
    ("validation_hook.py", r"--enable-response-store is not supported", "sglang.response-store-pd"),
    ("validation_hook.py (check_server_args)", r"--enable-watermark is not supported with PD", "sglang.watermark-pd"),
    ("pd_disaggregation_hook.py", r"host-receive-threshold must be between 0 and 1",
     "sglang.host-receive-threshold-range"),
    ("pd_disaggregation_hook.py", r"Decode host receive does not yet support|Decode host KV buffering requires",
     "sglang.host-receive-conflicts"),
    ("kv_cache_hook.py", r"host_pool is only supported on a PD decode server", "sglang.host-pool-on-prefill"),
    ("kv_cache_hook.py", r"disaggregation-decode-enable-offload-kvcache (is only supported|and)",
     "sglang.decode-offload-kvcache"),
    # the bare `assert tp_size % attn_dp_size == 0` of handle_data_parallelism: no message, only its place
    ("parallel_hook.py", r"^ @ sglang/srt/arg_groups/parallel_hook\.py:\d+$", "attn-dp-divides-tp"),
    ("validation_hook.py (check_server_args)", r"tp_size must be divisible by number of nodes", "nodes-divide-gpus"),
)
# CRD rules (the apiserver's) that deny shapes SGLang refuses at start; they count with the engine rules
SHAPE_RULES = {"attn-dp-divides-tp", "nodes-divide-gpus"}
STRUCTURAL = {r.id for r in CEL_RULES} | {"schema", "document", "yaml"}
STARTUP = {r.id for r in RULES["0.5.23"] if r.when == "start-up"} | {"engine-flag-unknown"}


def pdfleet_denials(obj: dict, role: Role) -> set[str]:
    verdict = validate_object(obj)
    spec = PDDeploymentSpec.model_validate(verdict.spec)
    inp = engine_input(spec)
    assert inp is not None
    errors, _ = evaluate_engine(dataclasses.replace(inp, roles=(role,)))
    shape = {v.rule for v in verdict.violations
             if v.rule in SHAPE_RULES and any(p.startswith(f"spec.{role.value}.") for p in v.paths)}
    return {v.rule for v in errors} & STARTUP | shape


def row_of(result: dict) -> str | None:
    text = f"{result['message']} @ {result.get('where', '')}"
    for _, pattern, rule in ROWS:
        if re.search(pattern, text):
            return rule
    return None


def as_sglang(obj: dict) -> dict | None:
    """An example as an SGLang deployment (its shape, transfer and layout), or None when SGLang's model
    family is unknown (inline layouts) or the spec does not parse."""
    v = validate_object(obj)
    if v.spec is None or any(x.rule in STRUCTURAL for x in v.violations):
        return None  # the apiserver itself refuses it: no pod, no command
    try:
        PDDeploymentSpec.model_validate(v.spec)
    except ValueError:
        return None
    if (v.spec.get("engine") or {}).get("kind") == "vllm":
        return None  # vLLM's examples: tests/vllm checks them against vLLM
    preset = (v.spec.get("model", {}).get("layout") or {}).get("preset")
    transfer = v.spec["transfer"]
    if preset not in MODEL_FAMILIES or (transfer["backend"], transfer["protocol"]) not in PROTOCOLS:
        return None  # no SGLang model family, or no command (admission: engine-protocol-unsupported)
    out = json.loads(json.dumps(obj))
    out.setdefault("metadata", {})["name"] = out.get("metadata", {}).get("name") or "example"
    if (out["spec"].get("engine") or {}).get("kind", "pdfleet") == "pdfleet":
        base = sglang_obj()["spec"]
        out["spec"]["engine"] = base["engine"]
        out["spec"]["model"] = {**out["spec"]["model"], "source": base["model"]["source"]}
    return out


def example_specs() -> list[tuple[str, dict]]:
    out = []
    for path in sorted((REPO / "examples").rglob("*.yaml")):
        try:
            docs = list(yaml.safe_load_all(path.read_text()))
        except yaml.YAMLError:
            continue
        for i, doc in enumerate(d for d in docs if isinstance(d, dict)):
            obj = as_sglang(doc) if doc.get("kind") == "PDDeployment" else None
            if obj is not None:
                out.append((f"{path.relative_to(REPO)}#{i}", obj))
    return out


CONTROLS = {
    # SGLang itself rejects Qwen3.8 Flash Next + MORI + PP 2 (the model check is live) ...
    "control/qwen-mori-pp2": sglang_obj(spec__transfer={"backend": "mori"},
                                        spec__prefill__parallelism={"tensor": 2, "pipeline": 2}),
    # ... and accepts the same spec with PP 1
    "control/qwen-mori-pp1": sglang_obj(spec__transfer={"backend": "mori"}),
    # the IB check runs against the fake tree: a listed device passes, one not in it is refused
    "control/ib-known": sglang_obj(spec__transfer={"backend": "mooncake", "rdmaDevices": ["mlx5_0", "mlx5_3"]}),
    "control/ib-unknown": sglang_obj(spec__transfer={"backend": "mooncake", "rdmaDevices": ["mlx5_0", "mlx5_9"]}),
}


@pytest.fixture(scope="module")
def checked(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("sglang")
    dirs = write_model_dirs(tmp / "models")
    home = tmp / "home"
    home.mkdir()
    specs = [(name, obj) for name, obj in CONTROLS.items()]
    specs += example_specs()
    specs += [(o["metadata"]["name"], o) for o in generated_specs(GENERATED)]
    specs += [(o["metadata"]["name"], o) for o in multi_node_specs()]
    cases, index, seen = [], [], {}
    for name, obj in specs:
        for role in Role:
            nodes = obj["spec"][role.value]["parallelism"].get("nodesPerReplica", 1)
            for rank in sorted({0, nodes - 1}):  # the group's first pod and its last
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
    return out


def test_positive_controls_first(checked) -> None:
    by_role = {(name, role): checked["results"][case] for name, _, role, case in checked["index"]}
    pp2 = by_role["control/qwen-mori-pp2", Role.PREFILL]
    assert not pp2["ok"] and "qwen4_exp.py" in pp2["where"], pp2
    assert by_role["control/qwen-mori-pp1", Role.PREFILL] == {"ok": True}
    assert by_role["control/qwen-mori-pp1", Role.DECODE] == {"ok": True}
    assert by_role["control/ib-known", Role.PREFILL] == {"ok": True}
    bad = by_role["control/ib-unknown", Role.PREFILL]
    assert not bad["ok"] and "Invalid IB devices" in bad["message"] and "mlx5_9" in bad["message"], bad


def test_pdfleet_and_sglang_agree(checked) -> None:
    res = checked["results"]
    sglang_hits = {rule: 0 for _, _, rule in ROWS}
    pdfleet_hits = {rule: 0 for _, _, rule in ROWS}
    disagreements = []
    for name, obj, role, case_id in checked["index"]:
        if name.startswith("control/ib-"):
            continue  # node facts (which devices a node has) are not the spec's: the control above
        r = res[case_id]
        ours = pdfleet_denials(obj, role)
        for rule in ours:
            pdfleet_hits[rule] = pdfleet_hits.get(rule, 0) + 1
        if r["ok"]:
            if ours:
                disagreements.append(f"{name}/{role.value}: SGLang accepts, pdfleet denies {sorted(ours)}")
            continue
        row = row_of(r)
        if row is None:
            disagreements.append(f"{name}/{role.value}: SGLang check with no row: {r['type']}: {r['message'][:300]}")
            continue
        sglang_hits[row] += 1
        if row not in ours:
            disagreements.append(f"{name}/{role.value}: SGLang rejects ({row}: {r['message'][:200]}), "
                                 f"pdfleet {sorted(ours) or 'admits'}")
    table = "\n".join(f"  {src:<40} {rule:<38} sglang={sglang_hits[rule]:<4} pdfleet={pdfleet_hits[rule]}"
                      for src, _, rule in ROWS)
    summary = (f"{len(checked['index'])} role checks ({len(res)} distinct) from {checked['examples']} examples, "
               f"{GENERATED} generated specs, {len(MULTI_NODE)} multi-node/shape specs and {len(CONTROLS)} "
               f"controls; SGLang import+warm-up "
               f"{checked['import_s']} s, cases {checked['cases_s']} s, wall {checked['wall_s']} s\n{table}")
    print(summary)
    assert not disagreements, "\n".join(disagreements[:40]) + "\n" + summary
    assert {rule for _, _, rule in ROWS} >= STARTUP, "a start-up rule without a row"
    empty = [rule for rule in sglang_hits if not sglang_hits[rule] or not pdfleet_hits.get(rule)]
    assert not empty, f"rows with zero hits: {empty}\n{summary}"


def test_committed_flag_set_is_the_parsers() -> None:
    proc = subprocess.run([sglang_python(), str(REPO / "scripts" / "sglang" / "flagset.py")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    committed = REPO / "runtime" / "pdfleet_runtime" / "engine_rules" / "sglang-0.5.23.flags.json"
    assert json.loads(proc.stdout) == json.loads(committed.read_text()), (
        "the committed flag set differs from SGLang's parser: regenerate it with scripts/sglang/flagset.py")


def test_multi_node_groups_start_and_are_admitted(checked) -> None:
    """Every member command of a multi-node spec starts in SGLang, and admission admits the spec (the
    operator runs SGLang replica groups); a bad shape is denied for its shape."""
    multi = [(name, obj, case) for name, obj, _, case in checked["index"] if name.startswith("mn-")]
    assert len({case for _, _, case in multi}) >= 8
    for name, obj, case in multi:
        assert checked["results"][case] == {"ok": True}, (case, checked["results"][case])
        assert {v.rule for v in validate_object(obj).violations} == set(), name
    for name, obj, _, case in checked["index"]:
        if name.startswith("bad-") and not checked["results"][case]["ok"]:
            assert {v.rule for v in validate_object(obj).violations} & SHAPE_RULES, name

"""SGLang engine fields at admission: owned flags, unknown flags and versions, CEL rules, SGLang's own
start-up and transfer-time rules, each denial naming the field (and the flag)."""

from __future__ import annotations

import pytest

from pdfleet_operator.validation import validate_object
from pdfleet_runtime.engine_rules import known_versions
from pdfleet_runtime.engine_rules.argv import flag_set, parse_args
from tests.unit.engine_rules.builders import sglang_obj


def rules_at(obj) -> set[tuple[str, str]]:
    v = validate_object(obj)
    return {(x.rule, p) for x in v.violations for p in x.paths}


def rule_ids(obj) -> set[str]:
    return {x.rule for x in validate_object(obj).violations}


def test_base_is_admitted_and_pdfleet_kind_needs_nothing_new() -> None:
    assert validate_object(sglang_obj()).admitted, validate_object(sglang_obj()).violations
    assert validate_object(sglang_obj(spec__engine={"kind": "pdfleet"}, spec__model__source=None)).admitted


@pytest.mark.parametrize(("args", "flag"), [
    (["--tp-size", "4"], "--tp-size"),
    (["--tp", "4"], "--tp"),                      # argparse prefix abbreviation of --tp-size
    (["--tensor-parallel-size=4"], "--tensor-parallel-size"),
    (["--pp-size", "2"], "--pp-size"),
    (["--dp-size", "2"], "--dp-size"),
    (["--enable-dp-attention"], "--enable-dp-attention"),
    (["--disaggregation-mode", "decode"], "--disaggregation-mode"),
    (["--disaggregation-transfer-backend", "nixl"], "--disaggregation-transfer-backend"),
    (["--disaggregation-bootstrap-port", "9000"], "--disaggregation-bootstrap-port"),
    (["--disaggregation-ib-device", "mlx5_0"], "--disaggregation-ib-device"),
    (["--host", "::"], "--host"),
    (["--port", "1"], "--port"),
    (["--model-path", "/x"], "--model-path"),
    (["--served-model-name", "x"], "--served-model-name"),
])
def test_owned_flags_are_denied_naming_field_and_flag(args, flag) -> None:
    v = validate_object(sglang_obj(spec__engine__args=["--mem-fraction-static", "0.85", *args]))
    owned = [x for x in v.violations if x.rule == "engine-flag-owned"]
    assert owned and all(x.paths == ("spec.engine.args[2]",) for x in owned), v.violations
    assert flag in owned[0].message and ("spec." in owned[0].message or "the operator (fixed" in owned[0].message)


def test_unknown_flag_ambiguous_prefix_and_bad_choice_are_denied() -> None:
    v = validate_object(sglang_obj(spec__decode__engine={"args": ["--no-such-flag", "--disagg", "x",
                                                                  "--disaggregation-decode-allocation-policy",
                                                                  "sometimes"]}))
    msgs = {x.paths[0]: x.message for x in v.violations if x.rule == "engine-flag-unknown"}
    assert "not a flag of sglang 0.5.23" in msgs["spec.decode.engine.args[0]"]
    assert "ambiguous" in msgs["spec.decode.engine.args[1]"]
    assert "is not one of early, prefill_complete" in msgs["spec.decode.engine.args[3]"]


def test_known_flags_parse_with_their_values() -> None:
    fs = flag_set("sglang", "0.5.23")
    p = parse_args(["--mem-fraction-static=0.8", "--enable-metrics", "--chunked-prefill-size", "-1",
                    "--disaggregation-decode-allocation-policy", "prefill_complete"], fs)
    assert not p.problems
    assert p.values["mem_fraction_static"] == "0.8" and p.values["enable_metrics"] is True
    assert p.values["chunked_prefill_size"] == "-1"  # a negative number is a value, as in argparse


def test_unknown_version_lists_known_ones_and_the_decode_only_upgrade_field() -> None:
    v = validate_object(sglang_obj(spec__decode__engine={"image": "lmsysorg/sglang:v0.5.24", "version": "0.5.24"}))
    (bad,) = [x for x in v.violations if x.rule == "engine-version-unknown"]
    assert bad.paths == ("spec.decode.engine.version",) and "known: 0.5.23" in bad.message
    assert known_versions("sglang") == ("0.5.23",)


@pytest.mark.parametrize(("edits", "rule", "path"), [
    ({"spec__engine__version": None}, "engine-fields", "spec.engine"),
    ({"spec__model__source": None}, "engine-model-source", "spec.model"),
    ({"spec__model__source": {"volume": {"emptyDir": {}}, "huggingFace": {"id": "Qwen/Q"}}},
     "model-source-one-form", "spec.model.source"),
    ({"spec__transfer__rdmaDevices": ["mlx5_0"], "spec__transfer__rdmaDeviceMap": {"0": ["mlx5_1"]}},
     "rdma-device-map", "spec.transfer.rdmaDeviceMap"),
    ({"spec__transfer__rdmaDeviceMap": {"gpu0": ["mlx5_1"]}}, "rdma-device-map", "spec.transfer.rdmaDeviceMap"),
])
def test_cel_rules(edits, rule, path) -> None:
    assert (rule, path) in rules_at(sglang_obj(**edits))


def test_role_override_needs_an_engine() -> None:
    obj = sglang_obj(spec__engine=None, spec__model__source=None)
    obj["spec"]["decode"]["engine"] = {"args": ["--x"]}
    assert "engine-role-override" in rule_ids(obj)


@pytest.mark.parametrize(("edits", "rule"), [
    ({"spec__transfer__backend": "mori", "spec__prefill__parallelism": {"tensor": 2, "pipeline": 2},
      "spec__decode__parallelism": {"tensor": 2, "pipeline": 2}}, "sglang.qwen4-exp-mori-pp"),
    ({"spec__engine__args": ["--enable-response-store"]}, "sglang.response-store-pd"),
    ({"spec__engine__args": ["--disaggregation-decode-allocation-policy", "prefill_complete"]},
     "sglang.prefill-complete-allocation"),
    ({"spec__transfer__backend": "mori", "spec__engine__stagingBuffer": True}, "sglang.staging-buffer-backend"),
    ({"spec__engine__env": [{"name": "SGLANG_DISAGG_STAGING_BUFFER", "value": "yes"}],
      "spec__transfer__backend": "mori"}, "sglang.staging-buffer-backend"),
    ({"spec__engine__args": ["--disaggregation-decode-host-receive-threshold", "0.5"]},
     "sglang.host-pool-on-prefill"),
    ({"spec__transfer__backend": "nixl", "spec__decode__parallelism": {"tensor": 1}}, "sglang.nixl-ple-hetero-tp"),
    ({"spec__transfer__backend": "nixl", "spec__decode__parallelism": {"tensor": 1}},
     "sglang.nixl-qsa-hetero-tp-mha"),
    ({"spec__transfer__backend": "mori", "spec__decode__parallelism": {"tensor": 1}}, "sglang.mori-qsa-hetero-tp"),
    ({"spec__model__layout": {"preset": "qwen3-next-hybrid"}, "spec__transfer__backend": "mori",
      "spec__decode__parallelism": {"tensor": 1}}, "sglang.mori-mamba-hetero-tp"),
    ({"spec__engine__args": ["--enable-pd-role-switch"], "spec__prefill__parallelism": {"tensor": 2, "pipeline": 2},
      "spec__decode__parallelism": {"tensor": 2, "pipeline": 2}}, "sglang.role-switch"),
    ({"spec__engine__args": ["--enable-watermark"]}, "sglang.watermark-pd"),
    ({"spec__engine__args": ["--enable-unified-memory"]}, "sglang.qwen4-exp-unified-memory"),
    ({"spec__engine__args": ["--enable-unified-memory"], "spec__model__layout": {"preset": "llama-dense"},
      "spec__transfer__backend": "nixl"}, "sglang.unified-memory-pd"),
    ({"spec__decode__engine": {"args": ["--disaggregation-decode-enable-offload-kvcache"]}},
     "sglang.decode-offload-kvcache"),
    ({"spec__decode__engine": {"args": ["--disaggregation-decode-host-receive-threshold=-0.5"]}},
     "sglang.host-receive-threshold-range"),
    ({"spec__decode__engine": {"args": ["--disaggregation-decode-host-receive-threshold", "0.5",
                                        "--enable-pd-role-switch"]}}, "sglang.host-receive-conflicts"),
])
def test_sglang_rules_deny_with_their_source(edits, rule) -> None:
    v = validate_object(sglang_obj(**edits))
    hits = [x for x in v.violations if x.rule == rule]
    assert hits, v.violations
    assert "python/sglang/srt/" in hits[0].reason and hits[0].matrix_version == "sglang==0.5.23"


def test_mla_pairs_qsa_across_tp_on_nixl() -> None:
    """NIXL maps QSA across TP sizes along MLA's replicated latent layout: no transfer-time rule."""
    v = validate_object(sglang_obj(spec__model__layout={"preset": "deepseek-mla"}, spec__transfer__backend="nixl",
                                   spec__decode__parallelism={"tensor": 1}))
    assert not {x.rule for x in v.violations} & {"sglang.nixl-qsa-hetero-tp-mha", "sglang.nixl-ple-hetero-tp"}


def test_rules_are_per_role() -> None:
    """host_pool belongs on decode: the same flag in decode's own args is admitted."""
    obj = sglang_obj()
    obj["spec"]["decode"]["engine"] = {"args": ["--disaggregation-decode-host-receive-threshold", "0.5"]}
    assert validate_object(obj).admitted, validate_object(obj).violations


def test_huggingface_source_is_a_warning() -> None:
    v = validate_object(sglang_obj(spec__model__source={"huggingFace": {"id": "Qwen/Qwen3.8-Flash-Next",
                                                                        "tokenSecret": "hf-token"}}))
    assert v.admitted and [w.rule for w in v.warnings].count("warn-engine-model-download") == 1


def test_matrix_engine_prints_every_rule_with_its_source(capsys) -> None:
    from pdfleet_operator import cli
    from pdfleet_runtime.engine_rules.sglang import RULES

    assert cli.main(["matrix", "--engine", "sglang==0.5.23"]) == 0
    out = capsys.readouterr().out
    for rule in RULES["0.5.23"]:
        assert rule.id in out and rule.source in out
    assert "MC_FORCE_TCP=1" in out and "--tp-size" in out
    assert {r.when for r in RULES["0.5.23"]} == {"start-up", "transfer"}
    assert cli.main(["matrix", "--engine", "sglang==0.5.24"]) == 1
    assert "known: sglang==0.5.23" in capsys.readouterr().err

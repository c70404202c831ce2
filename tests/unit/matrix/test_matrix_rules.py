"""Every rule of the capability matrix in both directions: an input that violates it and a close
neighbour that does not. A test also fails when a rule has no case here."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pdfleet_runtime.matrix import (
    GENERAL_RULES,
    LATEST_MATRIX_VERSION,
    MATRICES,
    LayoutFacts,
    MatrixInput,
    RoleInput,
    Severity,
    all_rules,
    evaluate,
    evaluate_rule,
    explain_rule,
    layout_facts,
)
from pdfleet_runtime.versions import RuntimeRelease, WireProtocol

LLAMA = layout_facts("llama-dense")
QWEN_FULL = layout_facts("qwen3.8-flash-next")
HYBRID = layout_facts("qwen3-next-hybrid")
MLA = layout_facts("deepseek-mla")
PLE_ONLY = replace(LLAMA, name="ple-only", state_types=frozenset({"kv", "ple_short_conv", "ple_ngram"}))
QSA_ONLY = replace(
    LLAMA,
    name="qsa-only",
    state_types=frozenset({"kv", "qsa_pending", "qsa_compressed"}),
    qsa_compress_ratio=4,
)
QSA_MLA = replace(
    MLA, name="qsa-mla", state_types=frozenset({"kv", "qsa_pending", "qsa_compressed"}), qsa_compress_ratio=4
)

# NemotronH-like: Mamba2 x (16 heads) | B | C (2 groups each), 12 value heads, conv groups declared.
MAMBA2 = replace(HYBRID, name="mamba2", linear_heads=(16,), conv_group_heads=(16, 2, 2), kv_heads=2)


def inp(
    layout: LayoutFacts | None = LLAMA,
    backend: str = "mooncake",
    protocol: str = "rdma",
    p: RoleInput | None = None,
    d: RoleInput | None = None,
) -> MatrixInput:
    return MatrixInput(layout, backend, protocol, p or RoleInput(4), d or RoleInput(2))


# rule id -> (violating input, passing input, a field path the violation must name)
CASES: dict[str, tuple[MatrixInput, MatrixInput, str]] = {
    "input-invalid": (inp(p=RoleInput(0)), inp(p=RoleInput(1)), "spec.prefill.parallelism.tensor"),
    "layout-unresolved": (inp(layout=None), inp(), "spec.model.layout"),
    "builtin-no-attention-dp": (
        inp(p=RoleInput(4, data=2)),
        replace(inp(p=RoleInput(4, data=2)), engine="sglang"),
        "spec.prefill.parallelism.data",
    ),
    "builtin-no-expert-parallel": (
        inp(d=RoleInput(2, expert=2)),
        replace(inp(d=RoleInput(2, expert=2)), engine="sglang"),
        "spec.decode.parallelism.expert",
    ),
    "attn-dp-divides-tp": (
        inp(p=RoleInput(4, data=3)),
        inp(p=RoleInput(4, data=4)),
        "spec.prefill.parallelism.data",
    ),
    "ep-divides-tp": (
        inp(d=RoleInput(2, expert=8)),
        inp(d=RoleInput(2, expert=2)),
        "spec.decode.parallelism.expert",
    ),
    "nodes-divide-gpus": (
        inp(p=RoleInput(4, 1, nodes_per_replica=3)),
        inp(p=RoleInput(4, 1, nodes_per_replica=2)),
        "spec.prefill.parallelism.nodesPerReplica",
    ),
    "tp-divisible": (
        inp(p=RoleInput(4), d=RoleInput(6)),
        inp(p=RoleInput(4), d=RoleInput(8)),
        "spec.decode.parallelism.tensor",
    ),
    "pp-match": (
        inp(p=RoleInput(4, 2), d=RoleInput(2, 4)),
        inp(p=RoleInput(4, 2), d=RoleInput(2, 1)),
        "spec.decode.parallelism.pipeline",
    ),
    "pp-layers": (
        inp(p=RoleInput(2, 64), d=RoleInput(2, 1)),
        inp(p=RoleInput(2, 32), d=RoleInput(2, 1)),
        "spec.prefill.parallelism.pipeline",
    ),
    "kv-heads-tp": (
        inp(p=RoleInput(6), d=RoleInput(3)),
        inp(p=RoleInput(8), d=RoleInput(4)),
        "spec.model.layout.preset",
    ),
    "linear-heads-tp": (
        inp(HYBRID, p=RoleInput(64), d=RoleInput(64)),
        inp(HYBRID, p=RoleInput(16), d=RoleInput(16)),
        "spec.decode.parallelism.tensor",
    ),
    "conv-groups-tp": (
        inp(MAMBA2, p=RoleInput(3), d=RoleInput(3)),
        inp(MAMBA2, p=RoleInput(8), d=RoleInput(8)),
        "spec.decode.parallelism.tensor",
    ),
    "qsa-page-ratio": (
        inp(replace(QSA_ONLY, page_size=66, paths={"page_size": "spec.model.layout.inline.pageSize"})),
        inp(replace(QSA_ONLY, page_size=64)),
        "spec.model.layout.inline.pageSize",
    ),
    "pool-fits-gpu": (
        inp(p=RoleInput(1, kv_tokens=1 << 22), d=RoleInput(1)),
        inp(p=RoleInput(1), d=RoleInput(1)),
        "spec.prefill.pool.kvTokensPerReplica",
    ),
    "runtime-version-unknown": (
        inp(d=RoleInput(2, runtime_version="9.9.9")),
        inp(d=RoleInput(2, runtime_version="0.1.0+cu13")),
        "spec.decode.runtimeVersion",
    ),
    "mooncake.protocol-shm": (inp(protocol="shm"), inp(protocol="nvlink"), "spec.transfer.protocol"),
    "nixl.replicated-hetero-tp": (
        inp(PLE_ONLY, "nixl"),
        inp(PLE_ONLY, "nixl", d=RoleInput(4)),
        "spec.decode.parallelism.tensor",
    ),
    "nixl.qsa-hetero-tp-mha": (
        inp(QSA_ONLY, "nixl"),
        inp(QSA_MLA, "nixl"),
        "spec.prefill.parallelism.tensor",
    ),
    "mori.qsa-pipeline": (
        inp(QWEN_FULL, "mori", p=RoleInput(2, 2), d=RoleInput(2, 1)),
        inp(HYBRID, "mori", p=RoleInput(2, 2), d=RoleInput(2, 1)),
        "spec.prefill.parallelism.pipeline",
    ),
    "mori.qsa-hetero-tp-mha": (
        inp(QSA_ONLY, "mori"),
        inp(QSA_ONLY, "mori", d=RoleInput(4)),
        "spec.decode.parallelism.tensor",
    ),
    "mori.qsa-hetero-tp-mla": (inp(QSA_MLA, "mori"), inp(QSA_MLA, "mooncake"), "spec.transfer.backend"),
    "mori.replicated-hetero-tp": (
        inp(PLE_ONLY, "mori"),
        inp(PLE_ONLY, "mooncake"),
        "spec.decode.parallelism.tensor",
    ),
    "mori.protocol-tcp": (inp(backend="mori", protocol="tcp"), inp(backend="mori"), "spec.transfer.protocol"),
    "mori.protocol-nvlink": (
        inp(backend="mori", protocol="nvlink"),
        inp(backend="nixl", protocol="nvlink"),
        "spec.transfer.protocol",
    ),
    "mori.protocol-shm": (
        inp(backend="mori", protocol="shm"),
        inp(backend="nixl", protocol="shm"),
        "spec.transfer.protocol",
    ),
    "warn-tcp-transfer": (inp(protocol="tcp"), inp(), "spec.transfer.protocol"),
    "warn-same-node-protocol": (inp(protocol="nvlink"), inp(protocol="rdma"), "spec.transfer.protocol"),
    "warn-mori-rocm": (inp(backend="mori"), inp(backend="nixl"), "spec.transfer.backend"),
    "warn-kv-heads-replicated": (
        inp(p=RoleInput(16), d=RoleInput(8)),
        inp(p=RoleInput(8), d=RoleInput(8)),
        "spec.prefill.parallelism.tensor",
    ),
}
# Reached only with a second runtime release or a bug; tested on their own below.
SEPARATE = {"runtime-protocol-mismatch", "matrix-internal-error"}


def test_every_rule_has_a_case() -> None:
    assert set(all_rules()) == set(CASES) | SEPARATE


@pytest.mark.parametrize("rule_id", sorted(CASES))
def test_rule_both_directions(rule_id: str) -> None:
    bad, good, path = CASES[rule_id]
    found = evaluate_rule(rule_id, bad)
    assert found, f"{rule_id} not reported"
    assert any(path in v.paths for v in found), [v.paths for v in found]
    assert all(v.reason and v.fix and v.message for v in found)
    assert not evaluate_rule(rule_id, good), f"{rule_id} reported on the passing input"
    full = evaluate(bad)
    reported = full.violations if all_rules()[rule_id].severity is Severity.ERROR else full.warnings
    assert rule_id in {v.rule for v in reported}
    assert not any(v.rule == "matrix-internal-error" for v in full.violations + full.warnings)


def test_runtime_protocol_mismatch_names_both_roles() -> None:
    releases = {
        "0.1.0": RuntimeRelease("0.1.0", "1", WireProtocol(1, 0)),
        "0.1.1": RuntimeRelease("0.1.1", "1", WireProtocol(1, 3)),
        "0.2.0": RuntimeRelease("0.2.0", "1", WireProtocol(2, 0)),
    }
    bad = inp(p=RoleInput(4, runtime_version="0.1.0"), d=RoleInput(2, runtime_version="0.2.0"))
    good = inp(p=RoleInput(4, runtime_version="0.1.0"), d=RoleInput(2, runtime_version="0.1.1"))
    found = [v for v in evaluate(bad, releases=releases).violations if v.rule == "runtime-protocol-mismatch"]
    assert len(found) == 1
    assert set(found[0].paths) == {"spec.prefill.runtimeVersion", "spec.decode.runtimeVersion"}
    assert "0.1.0" in found[0].message and "0.2.0" in found[0].message
    assert not evaluate(good, releases=releases).violations


def test_a_failing_rule_becomes_a_violation_not_an_exception() -> None:
    def boom(*_: int) -> int:
        raise RuntimeError("boom")

    verdict = evaluate(inp(replace(LLAMA, pool_bytes=boom)))
    assert [v.rule for v in verdict.violations] == ["matrix-internal-error"]
    assert "boom" in verdict.violations[0].message


def test_all_violations_at_once() -> None:
    v = evaluate(inp(QWEN_FULL, "mori", "tcp", RoleInput(8, 2, data=2), RoleInput(3, 4, runtime_version="9")))
    rules = {x.rule for x in v.violations}
    assert {
        "builtin-no-attention-dp",
        "tp-divisible",
        "pp-match",
        "kv-heads-tp",
        "linear-heads-tp",
        "runtime-version-unknown",
        "mori.protocol-tcp",
        "mori.qsa-pipeline",
        "mori.replicated-hetero-tp",
        "mori.qsa-hetero-tp-mha",
    } <= rules
    assert not v.admitted


def test_valid_presets_are_admitted_by_their_backends() -> None:
    assert evaluate(inp(QWEN_FULL, "mooncake", p=RoleInput(4), d=RoleInput(2))).admitted
    assert evaluate(inp(HYBRID, "nixl", p=RoleInput(4), d=RoleInput(2))).admitted
    assert evaluate(inp(MLA, "mori", p=RoleInput(16), d=RoleInput(8))).admitted
    assert evaluate(inp(LLAMA, "mori", p=RoleInput(2, 2), d=RoleInput(2, 2))).admitted


def test_replicated_conv_groups_need_writer_election_across_tp() -> None:
    """B and C of 2 groups are replicated at TP 8: NIXL and MoRI cannot elect their writer across TP sizes,
    Mooncake can; equal TP needs no election."""
    for backend, ok in (("mooncake", True), ("nixl", False), ("mori", False)):
        v = evaluate(inp(MAMBA2, backend, p=RoleInput(8), d=RoleInput(4)))
        assert ("replicated conv channel groups" in " ".join(x.message for x in v.violations)) is not ok, backend
    assert not [x for x in evaluate(inp(MAMBA2, "nixl", p=RoleInput(4), d=RoleInput(4))).violations
                if "conv channel groups" in x.message]


def test_weights_count_in_the_gpu_memory_rule() -> None:
    """A preset counts the real model it stands for: Qwen3-Next-80B's ~148 GiB of bf16 weights cannot sit on one
    141 GiB GPU at TP 1, DeepSeek-V3's ~627 GiB of FP8 weights need 8 of them; Llama-3-8B fits anywhere."""
    v = evaluate(inp(HYBRID, "nixl", p=RoleInput(1), d=RoleInput(2)))
    (bad,) = [x for x in v.violations if x.rule == "pool-fits-gpu"]
    assert "prefill weights 148.4 GiB (148.4 GiB / 1) and pools" in bad.message
    assert "126.9 GiB (90% of 141 GiB) is available" in bad.message
    assert not evaluate(inp(MLA, "mori", p=RoleInput(8), d=RoleInput(4))).admitted
    assert evaluate(inp(LLAMA, "mooncake", p=RoleInput(1), d=RoleInput(1))).admitted


def test_rules_are_data_with_reasons() -> None:
    m = MATRICES[LATEST_MATRIX_VERSION]
    for cell in m.cells.values():
        if not cell.supported:
            assert cell.reason and cell.rule_id in m.rules
    for rule in all_rules().values():
        assert rule.reason and rule.fix and rule.title
    assert explain_rule("tp-divisible") is GENERAL_RULES["tp-divisible"]
    assert explain_rule("nope") is None


def test_pool_bytes_scale_with_shape_and_capacity() -> None:
    assert LLAMA.pool_bytes is not None
    one = LLAMA.pool_bytes(1, 1, 64, 131072)
    assert LLAMA.pool_bytes(2, 1, 64, 131072) == one // 2
    assert LLAMA.pool_bytes(1, 2, 64, 131072) == one // 2
    assert LLAMA.pool_bytes(1, 1, 64, 262144) > one
    # 32 layers x 2 (K, V) x 8 heads x 128 dims x 2 bytes per token, pages = tokens/16 + requests
    assert one == 32 * 2 * 8 * 128 * 2 * 16 * (131072 // 16 + 64)


def test_kv_heads_rule_covers_swa_only_layouts() -> None:
    swa_only = replace(LLAMA, name="swa-only", state_types=frozenset({"swa"}), kv_heads=2)
    assert [v.rule for v in evaluate_rule("kv-heads-tp", inp(swa_only, p=RoleInput(3), d=RoleInput(3)))] == [
        "kv-heads-tp",
        "kv-heads-tp",
    ]
    assert not evaluate_rule("kv-heads-tp", inp(swa_only, p=RoleInput(2), d=RoleInput(1)))


def test_inline_layout_facts_point_at_inline_fields() -> None:
    from pdfleet_runtime.layouts import LayoutRef

    ref = LayoutRef.model_validate(
        {
            "inline": {
                "numLayers": 4,
                "fullAttentionLayers": {"interval": 1},
                "kvHeads": 8,
                "headDim": 128,
                "pageSize": 16,
            }
        }
    )
    facts = layout_facts(ref)
    assert facts.path("kv_heads") == "spec.model.layout.inline.kvHeads"
    v = evaluate(inp(facts, p=RoleInput(3), d=RoleInput(3)))
    assert any("spec.model.layout.inline.kvHeads" in x.paths for x in v.violations)


def test_parallel_cells_name_admission_rules_and_print() -> None:
    from pdfleet_operator.commands.matrix import matrix_text
    from pdfleet_runtime.engine_rules.registry import PARALLEL_CELLS

    text = matrix_text(MATRICES[LATEST_MATRIX_VERSION])
    for cell in PARALLEL_CELLS:
        assert cell.reason
        if not cell.supported:
            assert cell.rule in all_rules(), cell
            assert f"no [{cell.rule}]" in text
    assert {c.feature for c in PARALLEL_CELLS if c.engine == "pdfleet" and not c.supported} == {
        "attention-dp", "expert-parallel"}
    assert {c.feature for c in PARALLEL_CELLS if c.supported} >= {"multi-node"}


def sglang(layout: LayoutFacts, p: RoleInput, d: RoleInput) -> MatrixInput:
    return replace(inp(layout, p=p, d=d), engine="sglang")


def test_head_rules_shard_over_the_attention_tp_with_attention_dp() -> None:
    # TP 6 does not divide LLaMA's 8 KV heads; with attention DP 3 the attention TP is 2, which does
    six = sglang(LLAMA, RoleInput(6), RoleInput(2))
    assert [v.rule for v in evaluate_rule("kv-heads-tp", six)] == ["kv-heads-tp"]
    assert not evaluate_rule("kv-heads-tp", sglang(LLAMA, RoleInput(6, data=3), RoleInput(2)))
    # TP 12 with DP 2: attention TP 6 still does not divide 8 heads, and the message says which size it checked
    (v,) = evaluate_rule("kv-heads-tp", sglang(LLAMA, RoleInput(12, data=2), RoleInput(2)))
    assert "attention TP 6 (TP 12 / attention DP 2)" in v.message
    assert "spec.prefill.parallelism.data" in v.paths
    # linear-attention heads (16, 32) are not divisible by 64, but by attention TP 64 / 4 = 16
    assert evaluate_rule("linear-heads-tp", sglang(HYBRID, RoleInput(64), RoleInput(16)))
    assert not evaluate_rule("linear-heads-tp", sglang(HYBRID, RoleInput(64, data=4), RoleInput(16)))


def test_pools_with_attention_dp_hold_each_groups_share() -> None:
    # MLA's latent KV is replicated over TP: a TP-8 rank holds all of it, unless attention DP splits the
    # replica's tokens over 8 groups of one rank each
    big = RoleInput(8, kv_tokens=1 << 22, max_requests=64)
    assert [v.rule for v in evaluate_rule("pool-fits-gpu", sglang(MLA, big, RoleInput(8)))] == ["pool-fits-gpu"]
    assert not evaluate_rule("pool-fits-gpu", sglang(MLA, replace(big, data=8), RoleInput(8)))
    # sharded MHA KV: attention DP moves heads into tokens, so the per-GPU bytes stay the same
    assert LLAMA.pool_bytes is not None
    assert LLAMA.pool_bytes(8, 1, 64, 1 << 20) == LLAMA.pool_bytes(4, 1, 32, 1 << 19)

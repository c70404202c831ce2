"""Property tests: the matrix is total (any input gives a verdict, never an exception) and reports
every violation at once (the full verdict is exactly the union of the rules run one by one)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdfleet_runtime.layouts import PRESETS
from pdfleet_runtime.matrix import (
    LayoutFacts,
    MatrixInput,
    RoleInput,
    all_rules,
    evaluate,
    evaluate_rule,
    layout_facts,
)

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

junk = st.one_of(st.none(), st.booleans(), st.floats(allow_nan=True), st.text(max_size=3), st.integers(-3, 3))
small_int = st.one_of(st.integers(1, 8), st.sampled_from([16, 32, 64]), st.integers(-2, 0), junk)
versions = st.sampled_from(["0.1.0", "0.1.0+cu13", "9.9.9", "not-a-version", ""])


def shapes(values: st.SearchStrategy[object]) -> st.SearchStrategy[RoleInput]:
    return st.builds(
        RoleInput,
        tensor=values,
        pipeline=values,
        data=values,
        expert=values,
        nodes_per_replica=values,
        runtime_version=st.one_of(versions, junk),
        max_requests=st.one_of(st.integers(1, 4096), junk),
        kv_tokens=st.one_of(st.integers(1, 1 << 24), junk),
        gpu_memory_gib=st.one_of(st.floats(0.5, 200), st.just(float("inf")), junk),
    )


layouts = st.one_of(
    st.none(),
    st.sampled_from(sorted(PRESETS)).map(layout_facts),
    st.builds(
        LayoutFacts,
        name=st.just("random"),
        num_layers=small_int,
        state_types=st.frozensets(
            st.sampled_from(
                [
                    "kv",
                    "swa",
                    "mamba",
                    "qsa_pending",
                    "qsa_compressed",
                    "ple_short_conv",
                    "ple_ngram",
                    "bogus",
                ]
            )
        ),
        mla=st.booleans(),
        kv_heads=small_int,
        page_size=small_int,
        linear_heads=st.tuples(small_int, small_int),
        qsa_compress_ratio=st.one_of(st.none(), small_int),
    ),
)
inputs = st.builds(
    MatrixInput,
    layout=layouts,
    backend=st.one_of(st.sampled_from(["mooncake", "nixl", "mori", "ucx"]), junk),
    protocol=st.one_of(st.sampled_from(["rdma", "tcp", "nvlink", "shm", "ib"]), junk),
    prefill=st.one_of(shapes(small_int), junk),
    decode=st.one_of(shapes(small_int), junk),
)


@FAST
@given(inputs)
def test_evaluate_is_total(inp: MatrixInput) -> None:
    verdict = evaluate(inp)
    assert verdict.matrix_versions
    for v in verdict.violations + verdict.warnings:
        assert v.rule in all_rules() and v.paths and v.message
        assert v.rule != "matrix-internal-error", v.message


@FAST
@given(inputs)
def test_every_violation_is_reported_at_once(inp: MatrixInput) -> None:
    verdict = evaluate(inp)
    full = {(v.rule, v.paths) for v in verdict.violations + verdict.warnings}
    one_by_one = {(v.rule, v.paths) for rule in all_rules() for v in evaluate_rule(rule, inp)}
    assert full == one_by_one

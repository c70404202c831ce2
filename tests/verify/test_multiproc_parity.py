"""Multi-process parity through the real engines: every rank a serving rank process, talking the protocol.

One test per (backend, shape combination); each runs every preset as its own pair of pods (the
serving rank processes ``serve`` runs, built from each preset's runtime config, and a fresh
bootstrap server per prefill pod). Each decode rank verifies its whole arena; the bytes and descriptors moved must equal the
in-process harness's for the same configuration (same planner, different transport). A
combination the matrix rejects is reported with the matrix's rule before any process starts.
"""

from __future__ import annotations

import time

import pytest

from pdfleet_runtime.layouts import PRESETS
from pdfleet_runtime.planner import source_ranks
from pdfleet_runtime.records import ParallelShape as S
from pdfleet_runtime.verify.cases import CaseSpec, GroupSpec
from pdfleet_runtime.verify.group import run_group
from pdfleet_runtime.verify.parity import run_parity
from pdfleet_runtime.verify.results import ParityConfig

pytestmark = pytest.mark.slow

COMBOS = {
    "equal-tp2": (S(2), S(2)),
    "tp4-to-tp2": (S(4), S(2)),
    "tp2-to-tp4": (S(2), S(4)),
    "pp2-to-pp1": (S(1, 2), S(1)),
}
REQUESTS, TOKENS = 2, 64


@pytest.mark.parametrize("combo", list(COMBOS))
@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_every_preset_is_byte_exact_across_processes(backend: str, combo: str) -> None:
    p, d = COMBOS[combo]
    cases = tuple(CaseSpec(name, REQUESTS, TOKENS, seed=11) for name in PRESETS)
    t0 = time.monotonic()
    results = run_group(GroupSpec(backend, p, d, cases, request_timeout_s=60.0))
    elapsed = time.monotonic() - t0
    admitted = 0
    for case, res in zip(cases, results, strict=True):
        cfg = ParityConfig(PRESETS[case.layout_name], p, d, REQUESTS, TOKENS, 11, backend, case.layout_name)
        local = run_parity(cfg)
        if local.rejection is not None:
            assert res.rejection is not None and res.rejection.rule == local.rejection.rule, case
            assert res.rejection.reason
            assert res.details is None, "a rejected case must not reach a process"
            continue
        admitted += 1
        assert res.ok, (case, res.first_mismatch, res.details)
        assert res.mismatched_bytes == 0
        assert res.bytes_by_state == local.bytes_by_state, case
        assert res.descriptors_by_state == local.descriptors_by_state, case
        # Every source rank reported for every request, on every decode rank (also ranks that sent nothing).
        pairs = sum(len(source_ranks(p, d, t, k)) for t, k in d.coords())
        assert res.details is not None
        assert sum(len(r.reports) for x in res.details.decode for r in x.results) == REQUESTS * pairs, case
        assert all(x.check.mismatched == 0 for x in res.details.decode)
        for served in res.details.prefill:
            assert served.released == served.requests == REQUESTS
            before, after = served.free_before, served.free_after
            assert after["slot"] == before["slot"] + REQUESTS and after["page"] > before["page"]
    assert admitted >= 3
    print(f"{backend} {combo}: {admitted} presets in {elapsed:.1f}s")


def test_cli_engine_backend_prints_the_local_json_shape(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from pdfleet_runtime.cli import main

    args = ["parity", "--layout", "deepseek-mla", "--prefill", "tp=2", "--decode", "tp=1", "--requests", "2",
            "--tokens", "40", "--seed", "3", "--json"]
    assert main(args) == 0
    local = json.loads(capsys.readouterr().out)
    assert main([*args, "--backend", "mooncake"]) == 0
    engine = json.loads(capsys.readouterr().out)
    assert set(engine) == set(local) and engine["backend"] == "mooncake" and engine["ok"] is True
    for key in ("bytes_moved", "descriptors", "bytes_by_state", "descriptors_by_state", "request_tokens",
                "mismatched_bytes", "first_mismatch", "rejected"):
        assert engine[key] == local[key], key

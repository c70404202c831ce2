"""The parity harness and CLI: byte-exact parity over generated layouts and shapes, closed-form bytes per
state type, detection of corrupted plans, and the matrix's rejections (exit 2)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pdfleet_runtime import matrix
from pdfleet_runtime.cli import main
from pdfleet_runtime.layouts import (
    PRESETS,
    AttentionKind,
    DType,
    LayerSet,
    Layout,
    LayoutError,
    LinearAttentionConfig,
    MLAConfig,
    PLEConfig,
    QSAConfig,
    SWAConfig,
    rank_buffers,
    stage_layers,
)
from pdfleet_runtime.planner import Blocks, PlanError, check_shapes
from pdfleet_runtime.records import ParallelShape
from pdfleet_runtime.seeded import request_lengths
from pdfleet_runtime.verify.parity import run_parity
from pdfleet_runtime.verify.results import ParityConfig
from tests.unit.runtime.builders import plan_all, tiny_hybrid

S = ParallelShape


# --------------------------------------------------------------------------- closed form


def closed_form_bytes(lay: Layout, p: ParallelShape, d: ParallelShape, lengths: list[int]) -> dict[str, int]:
    """Bytes that must move per state type, from the layout's documented numbers (docs/layouts.md).

    Sharded state lands once in total; replicated state once per decode TP rank (and, for the
    sentinel rings, once per decode stage that holds them).
    """
    page = lay.page_size
    pages = sum(-(-n // page) for n in lengths)
    reqs = len(lengths)
    nf = len(lay.full_attention_layer_ids)
    kvb = lay.dtype.itemsize
    stages = [set(stage_layers(lay.num_layers, d.pp, k)) for k in range(d.pp)]
    out: dict[str, int] = {}
    if nf:
        if lay.attention_kind is AttentionKind.MLA:
            assert lay.mla is not None
            out["kv"] = d.tp * pages * nf * page * (lay.mla.kv_lora_rank + lay.mla.qk_rope_head_dim) * kvb
        else:
            out["kv"] = d.tp * max(1, lay.kv_heads // d.tp) * pages * nf * 2 * page * lay.head_dim * kvb
    if lay.swa is not None and lay.swa_layer_ids:
        # Pages (aligned at 0) covering the last min(n, window) tokens of each request.
        w = lay.swa.window
        swa_pages = sum((n - 1) // page - max(0, n - w) // page + 1 for n in lengths)
        out["swa"] = (d.tp * max(1, lay.kv_heads // d.tp) * swa_pages * len(lay.swa_layer_ids) * 2 * page
                      * lay.head_dim * kvb)
    if (la := lay.linear_attention) is not None and lay.linear_layer_ids:
        conv = (la.conv_kernel - 1) * (2 * la.num_key_heads * la.key_head_dim + la.num_value_heads * la.value_head_dim)
        temporal = la.num_value_heads * la.key_head_dim * la.value_head_dim
        out["mamba"] = reqs * len(lay.linear_layer_ids) * (conv * la.conv_dtype.itemsize
                                                           + temporal * la.temporal_dtype.itemsize)
    if (q := lay.qsa) is not None and nf:
        rings = sum(1 for s in stages if s & set(lay.full_attention_layer_ids))
        ib = q.dtype.itemsize
        out["qsa_pending"] = d.tp * reqs * (nf * q.compress_ratio * q.index_heads * q.index_head_dim * ib
                                            + rings * q.compress_ratio * 4)
        out["qsa_compressed"] = d.tp * pages * nf * page // q.compress_ratio * q.index_heads * q.index_head_dim * ib
    if (pl := lay.ple) is not None:
        # The n-gram history lives with the PLE layers (stage 0 when there are none).
        rings = sum(1 for s in stages if s & set(lay.ple_layer_ids)) or 1
        out["ple_short_conv"] = (d.tp * reqs * len(lay.ple_layer_ids) * (pl.short_conv_kernel - 1)
                                 * pl.short_conv_width * pl.dtype.itemsize)
        out["ple_ngram"] = d.tp * reqs * rings * pl.ngram_context * 4
    return {k: v for k, v in out.items() if v}


SHAPES = [(S(4), S(4)), (S(4), S(2)), (S(2), S(4)), (S(4, 2), S(4, 1)), (S(8, 2), S(1, 1)), (S(1, 4), S(8, 4))]


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize(("p", "d"), SHAPES, ids=[f"{p}->{d}" for p, d in SHAPES])
def test_planned_bytes_by_state_match_closed_form(name: str, p: ParallelShape, d: ParallelShape) -> None:
    lay = PRESETS[name]
    lengths = [1000, 63, 4097]
    out = plan_all(lay, p, d, lengths)
    total: dict[str, int] = {}
    for per_src in out.values():
        for blocks in per_src.values():
            for k, v in blocks.bytes_by_state().items():
                total[k] = total.get(k, 0) + v
    assert total == closed_form_bytes(lay, p, d, lengths)


@pytest.mark.parametrize(("name", "p", "d"), [
    ("qwen3.8-flash-next", S(4, 2), S(2, 1)),
    ("qwen3.8-flash-next", S(2), S(4)),
    ("llama-dense", S(8), S(1)),
    ("deepseek-mla", S(2, 2), S(2, 2)),
    ("qwen3-next-hybrid", S(1), S(2)),
])
def test_parity_on_presets_with_closed_form_bytes(name: str, p: ParallelShape, d: ParallelShape) -> None:
    cfg = ParityConfig(PRESETS[name], p, d, requests=2, tokens=200, seed=5, layout_name=name)
    res = run_parity(cfg)
    assert res.rejection is None and res.ok and res.mismatched_bytes == 0
    assert res.bytes_by_state == closed_form_bytes(PRESETS[name], p, d, res.request_tokens)
    assert set(res.bytes_by_state) == {s.value for s in PRESETS[name].state_types()}


# --------------------------------------------------------------------------- property test


@st.composite
def layouts(draw: st.DrawFn) -> Layout:
    n = draw(st.integers(1, 8))
    mla = draw(st.booleans())
    linear = draw(st.booleans())
    swa = not mla and draw(st.booleans())
    kinds = ["full"] + (["linear"] if linear else []) + (["swa"] if swa else [])
    per_layer = [draw(st.sampled_from(kinds)) for _ in range(n)]
    page = draw(st.sampled_from([1, 2, 4, 8]))
    full = [i for i, k in enumerate(per_layer) if k == "full"]
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    kw: dict = {
        "num_layers": n,
        "full_attention_layers": LayerSet(ids=full),
        "page_size": page,
        "dtype": draw(st.sampled_from([DType.BFLOAT16, DType.FLOAT32, DType.FLOAT8_E4M3FN])),
    }
    if mla:
        kw |= {"attention_kind": AttentionKind.MLA, "kv_heads": 1,
               "mla": MLAConfig(kv_lora_rank=draw(st.sampled_from([2, 4])), qk_rope_head_dim=draw(st.sampled_from([0, 2])))}
    else:
        kw |= {"kv_heads": heads, "head_dim": draw(st.sampled_from([1, 3]))}
    if linear:
        kh = draw(st.sampled_from([1, 2, 4, 8]))
        kw["linear_attention"] = LinearAttentionConfig(
            num_key_heads=kh, num_value_heads=kh * draw(st.sampled_from([1, 2])),
            key_head_dim=draw(st.sampled_from([1, 2])), value_head_dim=draw(st.sampled_from([1, 3])),
            conv_kernel=draw(st.sampled_from([2, 3])), conv_dtype=DType.BFLOAT16,
            temporal_dtype=draw(st.sampled_from([DType.FLOAT32, DType.BFLOAT16])))
    if swa:
        kw["swa"] = SWAConfig(window=draw(st.integers(1, 3 * page)),
                              layers=LayerSet(ids=[i for i, k in enumerate(per_layer) if k == "swa"]))
    if draw(st.booleans()):
        ratio = draw(st.sampled_from([r for r in (1, 2, 4) if page % r == 0]))
        kw["qsa"] = QSAConfig(compress_ratio=ratio, index_heads=draw(st.sampled_from([1, 2])), index_head_dim=2)
    if draw(st.booleans()):
        ple_layers = draw(st.lists(st.integers(0, n - 1), unique=True, max_size=n))
        kw["ple"] = PLEConfig(short_conv_layers=LayerSet(ids=ple_layers), short_conv_width=draw(st.sampled_from([1, 3])),
                              short_conv_kernel=2, ngram_context=draw(st.sampled_from([1, 4])))
    return Layout(**kw)


def test_matrix_checks_kv_heads_for_swa_only_layouts() -> None:
    """SWA pages are sharded by KV head: the matrix must apply the heads rule without full attention too."""
    lay = Layout(num_layers=2, full_attention_layers=LayerSet(ids=[]), kv_heads=2, head_dim=4, page_size=4,
                 swa=SWAConfig(window=8, layers=LayerSet(interval=1)))
    res = run_parity(ParityConfig(lay, S(1), S(3), requests=1, tokens=8))
    assert res.rejection is not None and res.rejection.rule == "kv-heads-tp"


def _derivable(lay: Layout, p: ParallelShape, d: ParallelShape) -> bool:
    """Whether the shape rules and the layout split allow this combination (independent of the matrix)."""
    try:
        check_shapes(p, d)
        for shape in (p, d):
            for k in range(shape.pp):
                rank_buffers(lay, shape.tp, shape.pp, 0, k)
    except (PlanError, LayoutError):
        return False
    return True


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lay=layouts(),
    p_tp=st.integers(1, 8), p_pp=st.integers(1, 4), d_tp=st.integers(1, 8),
    d_pp_choice=st.sampled_from(["one", "same", "other"]),
    requests=st.integers(1, 3), extra_tokens=st.integers(0, 30), seed=st.integers(0, 2**16),
    backend=st.sampled_from(["local", "local", "mooncake", "nixl", "mori"]),
)
def test_parity_holds_for_every_admitted_combination(lay: Layout, p_tp: int, p_pp: int, d_tp: int, d_pp_choice: str,
                                                     requests: int, extra_tokens: int, seed: int, backend: str) -> None:
    d_pp = {"one": 1, "same": p_pp, "other": max(1, (p_pp % 4) + 1)}[d_pp_choice]
    p, d = S(p_tp, p_pp), S(d_tp, d_pp)
    cfg = ParityConfig(lay, p, d, requests=requests, tokens=requests + extra_tokens, seed=seed, backend=backend)
    res = run_parity(cfg)
    event("rejected" if res.rejection else "admitted")
    if res.rejection is not None:
        assert res.rejection.rule in matrix.all_rules() and res.rejection.reason and res.rejection.message
        if backend in ("local", "mooncake"):  # only general rules apply: they must match the derivation's limits
            assert not _derivable(lay, p, d), f"matrix rejected a servable combination: {res.rejection}"
        return
    assert _derivable(lay, p, d)
    assert res.ok, res.first_mismatch
    assert res.bytes_by_state == closed_form_bytes(lay, p, d, res.request_tokens)


# --------------------------------------------------------------------------- corruption is detected


def _cfg() -> ParityConfig:
    return ParityConfig(tiny_hybrid(8), S(2, 2), S(1, 1), requests=3, tokens=40, seed=9, layout_name="tiny")


def test_dropped_block_is_reported_with_buffer_layer_and_offset() -> None:
    def drop_first(b: Blocks) -> Blocks:
        return Blocks(b.src[1:], b.dst[1:], b.length[1:], b.state[1:])

    res = run_parity(_cfg(), tamper=drop_first)
    assert not res.ok and res.mismatched_bytes > 0 and res.first_mismatch is not None
    assert res.first_mismatch.state_type in {"kv", "mamba", "qsa_pending", "qsa_compressed", "ple_short_conv", "ple_ngram"}


def test_block_shifted_by_one_byte_is_detected_including_outside_bytes() -> None:
    def shift(b: Blocks) -> Blocks:
        dst = b.dst.copy()
        dst[np.argmax(b.length)] += 1  # writes one byte past its item: outside bytes change too
        return Blocks(b.src, dst, b.length, b.state)

    res = run_parity(_cfg(), tamper=shift)
    assert not res.ok and res.mismatched_bytes > 0


def test_request_lengths_split_tokens() -> None:
    lengths = request_lengths(100, 7, seed=3)
    assert len(lengths) == 7 and sum(lengths) == 100 and min(lengths) >= 1
    assert lengths != request_lengths(100, 7, seed=4)


# --------------------------------------------------------------------------- CLI


def test_cli_parity_json_and_exit_zero(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["parity", "--layout", "qwen3-next-hybrid", "--prefill", "tp=2,pp=2", "--decode", "tp=1,pp=1",
               "--requests", "2", "--tokens", "64", "--seed", "7", "--json"])
    line = capsys.readouterr().out.strip()
    assert rc == 0 and "\n" not in line
    doc = json.loads(line)
    assert doc["ok"] is True and doc["mismatched_bytes"] == 0 and doc["descriptors"] > 0
    assert doc["bytes_moved"] == sum(doc["bytes_by_state"].values())
    assert set(doc["bytes_by_state"]) == {"kv", "mamba"}


def test_cli_matrix_rejection_exits_two_with_rule_and_reason(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["parity", "--layout", "qwen3.8-flash-next", "--prefill", "tp=3", "--decode", "tp=2",
               "--requests", "1", "--tokens", "16"])
    out = capsys.readouterr().out
    assert rc == 2 and "tp-divisible" in out and "reason:" in out
    rc = main(["parity", "--layout", "qwen3.8-flash-next", "--prefill", "tp=4", "--decode", "tp=2",
               "--requests", "1", "--tokens", "16", "--backend", "nixl", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 2 and doc["ok"] is False and doc["rejected"]["rule"].startswith("nixl.")


def test_cli_unknown_preset_exits_two(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["parity", "--layout", "gpt-9", "--prefill", "tp=1", "--decode", "tp=1"]) == 2
    assert "known presets" in capsys.readouterr().err


def test_cli_mismatch_exits_one(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import pdfleet_runtime.verify.parity as parity

    real = parity.run_parity

    def broken(cfg: ParityConfig) -> parity.ParityResult:
        return real(cfg, tamper=lambda b: Blocks(b.src[:-1], b.dst[:-1], b.length[:-1], b.state[:-1]))

    monkeypatch.setattr(parity, "run_parity", broken)
    rc = main(["parity", "--layout", "llama-dense", "--prefill", "tp=2", "--decode", "tp=1",
               "--requests", "1", "--tokens", "32"])
    out = capsys.readouterr().out
    assert rc == 1 and "MISMATCH" in out and "first mismatch: decode rank 0: kv/" in out

"""SGLang 0.5.23's own pools against ``pdfleet layout --engine sglang==0.5.23``, per family and TP size.

tests/model/sglang_pools.py builds SGLang's memory pools on CPU in the SGLang check venv from each config of
tests/model/configs.py; what they register for PD transfer (item lengths, layer ids, sliceable dims, outer
counts, conv shard groups; KV, state, QSA pending and compressed lists) must equal what pdfleet derives in
pure code (``model.forms``) and, where the schema says it, what pdfleet's ``Layout`` gives per rank
(``layouts.rank_buffers``). DeepSeek-V3.2 runs at 64-token pages (SGLang's DSA asserts them).
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from collections import defaultdict
from functools import cache
from pathlib import Path

import pytest

from pdfleet_runtime.layouts import EntryField, ShapeError, StateType, rank_buffers
from pdfleet_runtime.model.families import model_facts
from pdfleet_runtime.model.forms import Engine, EngineForm, Split, engine_form
from tests.model.configs import CONFIGS

POOLS = Path(__file__).resolve().parent / "sglang_pools.py"
PAGE = 16
PAGES = {"deepseek_v32": 64}  # DSATokenToKVPool asserts 64-token physical pages
CASES = [(fam, tp) for fam in CONFIGS for tp in (1, 2)]


@cache
def sglang_pools() -> dict:
    from tests.sglang.harness import sglang_python

    cases = [{"id": f"{fam}-tp{tp}", "config": CONFIGS[fam], "tp": tp, "page_size": PAGES.get(fam, PAGE)}
             for fam, tp in CASES]
    with tempfile.TemporaryDirectory(prefix="sglang-pools-") as tmp:
        cases_file, results = Path(tmp) / "cases.json", Path(tmp) / "results.json"
        cases_file.write_text(json.dumps(cases))
        proc = subprocess.run([sglang_python(), str(POOLS), str(cases_file), str(results)], capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(results.read_text())


def _named(form: EngineForm, *prefixes: str) -> list:
    return [b for p in prefixes for b in form.buffers if b.name == p]


def _expected(form: EngineForm) -> dict:
    """The lists SGLang registers, in its order, as pdfleet's form predicts them."""
    out: dict = {}
    kv = _named(form, "MHATokenToKVPool.k_buffer", "MHATokenToKVPool.v_buffer", "MLATokenToKVPool.kv_buffer")
    out["kv"] = {"items": [b.item_bytes for b in kv], "layers": [b.layer_id for b in kv]}
    state = _named(form, "MambaPool.conv", "MambaPool.temporal", "ShortConvPool.conv_state", "NGramPool.context")
    if state:
        out["state"] = {
            "items": [b.item_bytes for b in state], "layers": [b.layer_id for b in state],
            "dims": [0 if b.split is Split.REPLICATED else b.shape[0] for b in state], "outer": [1] * len(state),
            "groups": [list(b.groups) if b.split is Split.GROUPS else None for b in state]}
    pending = _named(form, "QSATokenToKVPool.qsa_key_state_buffer_pool", "QSATokenToKVPool.qsa_rope_position_buffer")
    if pending:
        out["qsa_pending"] = {"items": [b.item_bytes for b in pending], "layers": [b.layer_id for b in pending]}
        compressed = _named(form, "QSATokenToKVPool.qsa_compressed_k_buffer_pool")
        out["qsa_compressed"] = {"items": [b.item_bytes for b in compressed],
                                 "layers": [b.layer_id for b in compressed]}
    dsa = _named(form, "DSATokenToKVPool.index_k_with_scale_buffer")
    if dsa:
        out["dsa_index"] = {"items": [b.item_bytes for b in dsa], "layers": [b.layer_id for b in dsa]}
    return out


def _form(fam: str, tp: int) -> EngineForm:
    return engine_form(model_facts(CONFIGS[fam]), Engine.SGLANG, tp=tp, page_size=PAGES.get(fam, PAGE))


@pytest.mark.slow
@pytest.mark.parametrize(("fam", "tp"), CASES, ids=[f"{f}-tp{t}" for f, t in CASES])
def test_sglang_registers_what_pdfleet_derives(fam: str, tp: int) -> None:
    got = sglang_pools()[f"{fam}-tp{tp}"]
    assert got.pop("ok"), got.get("trace")
    assert got == _expected(_form(fam, tp))


_LISTS = {
    (StateType.KV, EntryField.K): "MHATokenToKVPool.k_buffer", (StateType.KV, EntryField.V): "MHATokenToKVPool.v_buffer",
    (StateType.KV, EntryField.LATENT): "MLATokenToKVPool.kv_buffer", (StateType.MAMBA, EntryField.CONV): "MambaPool.conv",
    (StateType.MAMBA, EntryField.TEMPORAL): "MambaPool.temporal",
    (StateType.PLE_SHORT_CONV, EntryField.SHORT_CONV): "ShortConvPool.conv_state",
    (StateType.PLE_NGRAM, EntryField.NGRAM): "NGramPool.context",
    (StateType.QSA_PENDING, EntryField.PENDING): "QSATokenToKVPool.qsa_key_state_buffer_pool",
    (StateType.QSA_PENDING, EntryField.ROPE): "QSATokenToKVPool.qsa_rope_position_buffer",
    (StateType.QSA_COMPRESSED, EntryField.COMPRESSED): "QSATokenToKVPool.qsa_compressed_k_buffer_pool",
    (StateType.INDEX_K, EntryField.INDEX_K): "DSATokenToKVPool.index_k_with_scale_buffer",
}


@pytest.mark.parametrize(("fam", "tp"), CASES, ids=[f"{f}-tp{t}" for f, t in CASES])
def test_the_layout_gives_the_engine_forms_items(fam: str, tp: int) -> None:
    """pdfleet's own per-rank buffers (what pools, planner and matrix use) hold SGLang's items, layer for layer."""
    form = _form(fam, tp)
    assert form.layout is not None, form.missing
    ours: dict[str, list] = defaultdict(list)
    for buf in rank_buffers(form.layout, tp, 1, 0, 0):
        ours[_LISTS[buf.key]].append((int(buf.layer_id), buf.item_bytes))
    theirs: dict[str, list] = defaultdict(list)
    for b in form.buffers:
        theirs[b.name].append((b.layer_id, b.item_bytes))
    assert {k: sorted(v) for k, v in ours.items()} == {k: sorted(v) for k, v in theirs.items()}


def test_dsa_needs_what_sglang_asserts() -> None:
    """SGLang's DSA pool asserts 64-token pages and 128-dim index keys: pdfleet's SGLang form refuses others
    with the reason (the layout could not be allocated by the engine)."""
    with pytest.raises(ShapeError, match="64-token pages"):
        engine_form(model_facts(CONFIGS["deepseek_v32"]), Engine.SGLANG, tp=1, page_size=16)
    with pytest.raises(ShapeError, match="index_head_dim == 128"):
        engine_form(model_facts({**CONFIGS["deepseek_v32"], "index_head_dim": 64}), Engine.SGLANG, tp=1,
                    page_size=64)

"""vLLM 0.33.0's own KV-cache specs against ``pdfleet layout --engine vllm==0.33.0``, per family and TP size.

tests/model/vllm_specs.py builds the engine config a ``vllm serve DIR -tp N`` pod gets on the faked H200
(tests/vllm/shims) from each config of tests/model/configs.py, and reads vLLM's own specs: the attention
spec of one token (KV heads per rank, head size, bytes) and, for hybrid models, the model class's Mamba
state shapes, dtypes and page bytes, and DeepSeek-V3.2's indexer K cache (its ``Indexer`` built for one
layer: packed fp8 keys with scales, uint8). They must equal pdfleet's vLLM form. vLLM's Qwen4-Exp Mamba specs
(several layouts) are not derived: its form says so, and its attention part is still checked.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import pytest

from pdfleet_runtime.model.families import model_facts
from pdfleet_runtime.model.forms import Engine, EngineForm, Item, engine_form
from tests.model.configs import CONFIGS

HERE = Path(__file__).resolve().parent
PAGE = 16
CASES = [(fam, tp) for fam in CONFIGS for tp in (1, 2)]
# vLLM reads these families through their multimodal/registry names
_WRAP = {"qwen4_exp_text": ("qwen4_exp", "Qwen4ExpForCausalLM"), "qwen3_5_text": ("qwen3_5", "Qwen3_5ForCausalLM")}


def _config(fam: str) -> dict:
    cfg = CONFIGS[fam]
    if fam in _WRAP:
        mt, arch = _WRAP[fam]
        return {"model_type": mt, "architectures": [arch], "dtype": cfg["dtype"],
                "text_config": {k: v for k, v in cfg.items() if k != "model_type"}}
    return cfg


@cache
def vllm_specs() -> dict:
    from tests.vllm.harness import vllm_python

    python = vllm_python()
    with tempfile.TemporaryDirectory(prefix="vllm-specs-") as tmp:
        libcuda = Path(tmp) / "libcuda.so.1"
        subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-Wl,-soname,libcuda.so.1", "-o", str(libcuda),
                        str(HERE.parent / "vllm" / "shims" / "libcuda_stub.c")], check=True, capture_output=True, timeout=120)
        cases = []
        for fam in CONFIGS:
            d = Path(tmp) / fam
            d.mkdir()
            (d / "config.json").write_text(json.dumps(_config(fam)))
            cases += [{"id": f"{fam}-tp{tp}", "dir": str(d), "tp": tp} for tp in (1, 2)]
        (Path(tmp) / "cases.json").write_text(json.dumps(cases))
        proc = subprocess.run([python, str(HERE / "vllm_specs.py"), str(libcuda), str(Path(tmp) / "cases.json"),
                               str(Path(tmp) / "results.json")], capture_output=True, text=True, timeout=1500,
                              env={**os.environ, "TRITON_CACHE_DIR": str(Path(tmp) / "triton")})
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads((Path(tmp) / "results.json").read_text())


def _form(fam: str, tp: int) -> EngineForm:
    return engine_form(model_facts(CONFIGS[fam]), Engine.VLLM, tp=tp, page_size=PAGE)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the first case runs vLLM for all of them (a forked child per case)
@pytest.mark.parametrize(("fam", "tp"), CASES, ids=[f"{f}-tp{t}" for f, t in CASES])
def test_vllm_specs_are_what_pdfleet_derives(fam: str, tp: int) -> None:
    got = vllm_specs()[f"{fam}-tp{tp}"]
    assert got["ok"], got.get("trace")
    form = _form(fam, tp)
    attn = next(b for b in form.buffers if b.item is Item.PAGE)
    assert got["attn_bytes_per_token"] == attn.item_bytes // PAGE
    assert got["mla"] == (attn.name == "MLAAttentionSpec")
    assert (got["num_kv_heads"], got["head_size"]) == (attn.shape[-2], attn.shape[-1])
    assert got["sliding_window"] == attn.max_tokens
    if fam == "qwen4_exp_text":
        assert form.layout is None and form.missing  # named, not derived
    indexer = [b for b in form.buffers if b.name == "MLAAttentionSpec(indexer)"]
    assert ("indexer" in got) == bool(indexer)
    if indexer:
        spec, ours = got["indexer"], indexer[0]
        assert spec["kind"] == "MLAAttentionSpec" and spec["dtype"] == f"torch.{ours.dtype.value}"
        assert (spec["num_kv_heads"], spec["head_size"]) == ours.shape[1:]
        assert spec["bytes_per_block"] // spec["block_size"] == ours.item_bytes // PAGE
        assert form.layout is not None and form.layout.index_keys is not None
        assert form.layout.index_keys.token_shape[0][-1] == spec["head_size"]
    slots = [b for b in form.buffers if b.item is Item.SLOT]
    assert got["hybrid"] == bool(slots)
    if slots:
        gdn = [b for b in slots if b.name in ("MambaSpec.conv", "MambaSpec.temporal")][:2]
        ple = [b for b in slots if b.name == "MambaSpec.ple_conv"][:1]
        expected = [[list(b.shape) for b in spec] for spec in (gdn, ple) if spec]
        assert [s["shapes"] for s in got["mamba"]] == expected
        assert [s["dtypes"] for s in got["mamba"]] == [[f"torch.{b.dtype.value}" for b in spec]
                                                      for spec in (gdn, ple) if spec]
        assert [s["page_bytes"] for s in got["mamba"]] == [sum(b.item_bytes for b in spec) for spec in (gdn, ple)
                                                           if spec]

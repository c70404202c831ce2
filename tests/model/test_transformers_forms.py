"""transformers 5.23.0's own cache against ``pdfleet layout --engine transformers``, per family.

Each config of tests/model/configs.py is built as a tiny model (random weights, float32 compute so every
layer runs on CPU), one 7-token prompt goes through it, and every tensor of its ``DynamicCache`` is read
back: per layer and name, the item shape (one token of KV and index keys, one request of conv and recurrent
state) and dtype must be what ``model.forms`` derives at TP 1, and at TP 2 the sharded buffers must split it
exactly (heads, q|k|v or x|B|C channels, value heads) while the replicated ones stay whole.
"""

from __future__ import annotations

import math

import pytest

from pdfleet_runtime.layouts import DType
from pdfleet_runtime.model.families import model_facts
from pdfleet_runtime.model.forms import Engine, FormBuffer, Split, engine_form
from tests.model.configs import CONFIGS

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPT = 7
FAMILIES = list(CONFIGS)


def _cache(fam: str) -> dict[tuple[str, int], tuple[tuple[int, ...], str]]:
    """(name, layer) -> (item shape, dtype) of every tensor the model's cache holds after one prompt."""
    cfg = {k: v for k, v in CONFIGS[fam].items() if k not in ("architectures", "model_type")}
    cfg["dtype"] = "float32"
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(CONFIGS[fam]["model_type"], **cfg)
    model = transformers.AutoModelForCausalLM.from_config(config)
    out = model(torch.randint(2, 200, (1, PROMPT)), use_cache=True)
    found: dict[tuple[str, int], tuple[tuple[int, ...], str]] = {}
    for i, layer in enumerate(out.past_key_values.layers):
        cls = type(layer).__name__
        for attr in ("keys", "values", "indexer_keys"):
            t = getattr(layer, attr, None)
            if t is not None:  # [1, heads, S, d] (keys/values) or [1, S, d] (index keys): one token's share
                shape = tuple(t.shape[1:2]) + tuple(t.shape[3:]) if t.dim() == 4 else tuple(t.shape[2:])
                found[(f"{cls}.{attr}", i)] = (shape, str(t.dtype).removeprefix("torch."))
        pos = getattr(layer, "indexer_position_ids", None)
        if pos is not None:  # [3, 1, S]
            found[(f"{cls}.indexer_position_ids", i)] = ((pos.shape[0],), str(pos.dtype).removeprefix("torch."))
        for attr in ("conv_states", "recurrent_states"):
            for k, t in (getattr(layer, attr, None) or {}).items():
                if t is not None:
                    found[(f"{cls}.{attr}[{k}]", i)] = (tuple(t.shape[1:]), str(t.dtype).removeprefix("torch."))
    return found


def _dtype(b: FormBuffer) -> str:
    # the model computed in float32: the form's float dtypes follow it (int64 ids stay)
    return "int64" if b.dtype is DType.INT64 else "float32"


@pytest.mark.slow
@pytest.mark.parametrize("fam", FAMILIES)
def test_transformers_cache_holds_what_pdfleet_derives(fam: str) -> None:
    facts = model_facts({**CONFIGS[fam], "dtype": "float32"})
    form = engine_form(facts, Engine.TRANSFORMERS, tp=1)
    cache = _cache(fam)
    derived = {(b.name, b.layer_id): (b.shape, _dtype(b)) for b in form.buffers}
    assert derived == cache
    sliding = [b for b in form.buffers if b.max_tokens is not None]
    assert all(b.max_tokens == facts.sliding_window - 1 for b in sliding)  # type: ignore[operator]
    two = engine_form(facts, Engine.TRANSFORMERS, tp=2)
    for one, half in zip(form.buffers, two.buffers, strict=True):
        whole, part = math.prod(one.shape), math.prod(half.shape)
        if one.split is Split.REPLICATED or (one.split is Split.HEADS and facts.kv_heads < 2):
            assert part == whole, one
        else:
            assert 2 * part == whole or (one.split is Split.GROUPS and 2 * part > whole), one

"""A model's per-request state in the form one engine keeps it (pure: stdlib and layouts).

The same model is stored differently by different engines: transformers keeps Qwen4-Exp's raw per-token
index keys, SGLang 0.5.23 a pending ring, compressed-K pages and a RoPE ring; transformers keeps K GDN conv
columns, SGLang K-1 in bfloat16. ``engine_form(facts, engine, tp=..., page_size=...)`` lists the buffers
one TP rank of that engine holds, each named as the engine's own code names it (a cache attribute, a pool
attribute), with its item (one token, one page, or one request slot), shape, dtype and TP split, and, where
pdfleet's schema can say it, the ``Layout`` that describes it (``EngineForm.layout``); ``missing`` names
what the schema lacks otherwise. docs/layouts.md is the table; the engine checks are tests/model/.

Sources (file:line in each engine's installed package):

* transformers 5.23.0: ``cache_utils.py`` (DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer,
  DynamicIndexedLayer), shapes read back from a tiny model's cache in tests/model/test_transformers_forms.py.
* SGLang 0.5.23: ``mem_cache/memory_pool.py`` (MHATokenToKVPool, MLATokenToKVPool, MambaPool,
  HybridLinearKVPool), ``mem_cache/qsa_kv_pool.py`` (QSATokenToKVPool), ``mem_cache/ple_state_pool.py``
  (ShortConvPool, NGramPool), ``configs/mamba_utils.py`` (Mamba2StateShape.create),
  ``configs/model_config.py:2651`` (is_hybrid_swa_model: Mistral is not one, it keeps full KV).
* vLLM 0.33.0: ``v1/kv_cache_interface.py`` (FullAttentionSpec, SlidingWindowSpec, MLAAttentionSpec,
  MambaSpec), ``model_executor/models/deepseek_v2.py`` (DeepseekV32IndexerCache: DSA's packed index keys).
* SGLang's DSA: ``mem_cache/memory_pool.py`` (DSATokenToKVPool), ``mem_cache/index_key_cache.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum

from pdfleet_runtime.ids import PLE_NGRAM_LAYER_ID, QSA_ROPE_LAYER_ID
from pdfleet_runtime.layouts import (
    AttentionKind,
    ConvGroup,
    DType,
    IndexKeysConfig,
    LayerSet,
    Layout,
    LinearAttentionConfig,
    MLAConfig,
    PLEConfig,
    PositionsConfig,
    QSAConfig,
    ShapeError,
    SWAConfig,
)
from pdfleet_runtime.model.families import FULL, INDEXED, LINEAR, MAMBA, NONE, SLIDING, ModelFacts

__all__ = ["ENGINES", "Engine", "EngineForm", "FormBuffer", "Item", "Split", "engine_form"]


class Engine(StrEnum):
    """The engines (and versions) whose state forms pdfleet derives."""

    TRANSFORMERS = "transformers"
    SGLANG = "sglang==0.5.23"
    VLLM = "vllm==0.33.0"


ENGINES = tuple(e.value for e in Engine)


class Item(StrEnum):
    """What one item of a buffer is: the state of one token, one page of tokens, or one request."""

    TOKEN = "token"
    PAGE = "page"
    SLOT = "slot"


class Split(StrEnum):
    """How TP ranks share a buffer."""

    HEADS = "heads"  # KV heads, replicated when tp exceeds them
    GROUPS = "groups"  # a channel dim in groups, each sharded on its own (GDN q|k|v)
    DIM = "dim"  # one sliced dim (heads of a recurrent state)
    REPLICATED = "replicated"


@dataclass(frozen=True)
class FormBuffer:
    """One buffer of one TP rank, as the engine names and shapes it; ``shape`` is one item's."""

    name: str
    layer_id: int
    item: Item
    shape: tuple[int, ...]
    dtype: DType
    split: Split
    tokens_per_item: int = 1  # PAGE: the page size
    max_tokens: int | None = None  # a sliding window keeps at most this many tokens
    groups: tuple[int, ...] = ()  # GROUPS: the global widths of the groups

    @property
    def item_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class EngineForm:
    """Every buffer one TP rank of ``engine`` holds for ``family`` at ``tp``, and the layout that says it."""

    engine: Engine
    family: str
    tp: int
    page_size: int
    buffers: tuple[FormBuffer, ...]
    empty_layers: tuple[int, ...] = ()
    layout: Layout | None = None
    missing: tuple[str, ...] = ()  # forms pdfleet's schema cannot express yet
    notes: tuple[str, ...] = field(default=())

    @property
    def bytes_per_token(self) -> float:
        """Per rank: bytes a token adds (token and page buffers, a page's bytes spread over its tokens)."""
        return sum(b.item_bytes / b.tokens_per_item for b in self.buffers if b.item is not Item.SLOT)

    @property
    def bytes_per_slot(self) -> int:
        """Per rank: bytes of one request's fixed-size state (recurrent, conv, rings, n-grams)."""
        return sum(b.item_bytes for b in self.buffers if b.item is Item.SLOT)


def _check_heads(what: str, heads: int, tp: int, *, both_ways: bool = False) -> None:
    if heads % tp and not (both_ways and tp % heads == 0):
        raise ShapeError(f"{what} {heads} and tp={tp} must divide one another" if both_ways
                         else f"{what} {heads} is not divisible by tp={tp}", what)


class _Builder:
    def __init__(self, facts: ModelFacts, engine: Engine, tp: int, page_size: int) -> None:
        if tp < 1:
            raise ShapeError(f"tp={tp} must be at least 1", "tp")
        self.f, self.engine, self.tp, self.page = facts, engine, tp, page_size
        self.out: list[FormBuffer] = []
        self.missing: list[str] = []
        self.notes: list[str] = []

    def add(self, name: str, layer: int, item: Item, shape: tuple[int, ...], dtype: DType, split: Split,
            **kw: object) -> None:
        if item is Item.PAGE:
            kw.setdefault("tokens_per_item", self.page)
        self.out.append(FormBuffer(name, layer, item, shape, dtype, split, **kw))  # type: ignore[arg-type]

    @property
    def hpr(self) -> int:
        _check_heads("num_key_value_heads", self.f.kv_heads, self.tp, both_ways=True)
        return max(1, self.f.kv_heads // self.tp)


# --------------------------------------------------------------------------- transformers 5.23.0


def _transformers(b: _Builder) -> None:
    f, tp = b.f, b.tp
    first_indexed = min(f.layers_of(INDEXED), default=None)
    for layer, kind in enumerate(f.layer_kinds):
        if kind in (FULL, SLIDING, INDEXED):
            cls = {FULL: "DynamicLayer", SLIDING: "DynamicSlidingWindowLayer", INDEXED: "DynamicIndexedLayer"}[kind]
            if f.family == "deepseek_v32":
                cls = "DynamicIndexedLayer"
            cap = (f.sliding_window - 1) if kind == SLIDING and f.sliding_window else None
            if f.mla is not None:
                b.add(f"{cls}.keys", layer, Item.TOKEN, (1, f.mla[0]), f.dtype, Split.REPLICATED)
                b.add(f"{cls}.values", layer, Item.TOKEN, (1, f.mla[1]), f.dtype, Split.REPLICATED)
            else:
                for name in ("keys", "values"):
                    b.add(f"{cls}.{name}", layer, Item.TOKEN, (b.hpr, f.head_dim), f.dtype, Split.HEADS,
                          max_tokens=cap)
            if f.indexer is not None and (kind == INDEXED or f.family == "deepseek_v32"):
                b.add(f"{cls}.indexer_keys", layer, Item.TOKEN, (f.indexer.head_dim,), f.dtype, Split.REPLICATED)
                if kind == INDEXED and layer == first_indexed:
                    b.add(f"{cls}.indexer_position_ids", layer, Item.TOKEN, (3,), DType.INT64, Split.REPLICATED)
        elif kind == LINEAR:
            la = f.linear
            assert la is not None
            _check_heads("linear_num_key_heads", la.key_heads, tp)
            _check_heads("linear_num_value_heads", la.value_heads, tp)
            b.add("LinearAttentionLayer.conv_states[0]", layer, Item.SLOT, (sum(la.groups) // tp, la.conv_kernel),
                  f.dtype, Split.GROUPS, groups=la.groups)
            if f.ple is not None and layer in f.ple.layers:
                b.add("LinearAttentionLayer.conv_states[1]", layer, Item.SLOT, (f.ple.channels, f.ple.columns),
                      f.dtype, Split.REPLICATED)
                b.add("LinearAttentionLayer.conv_states[2]", layer, Item.SLOT, (f.ple.ngram_size - 1,),
                      DType.INT64, Split.REPLICATED)
            b.add("LinearAttentionLayer.recurrent_states[0]", layer, Item.SLOT,
                  (la.value_heads // tp, la.key_dim, la.value_dim), DType.FLOAT32, Split.DIM)
        elif kind == MAMBA:
            m = f.mamba2
            assert m is not None
            _check_heads("mamba_num_heads", m.heads, tp)
            groups = _mamba_groups(m.n_groups, tp)
            conv = (m.x_channels + 2 * groups * m.state_size) // tp
            b.add("LinearAttentionLayer.conv_states[0]", layer, Item.SLOT, (conv, m.conv_kernel), f.dtype,
                  Split.GROUPS, groups=(m.x_channels, m.n_groups * m.state_size, m.n_groups * m.state_size))
            b.add("LinearAttentionLayer.recurrent_states[0]", layer, Item.SLOT,
                  (m.heads // tp, m.head_dim, m.state_size), m.ssm_dtype, Split.DIM)
    if f.linear or f.mamba2:
        b.notes.append("conv_states[0] keeps K columns; the oldest is never read, so K-1 move "
                       "(docs/reference-engine.md)")
    if f.sliding_window:
        b.notes.append(f"sliding layers keep the last sliding_window-1 = {f.sliding_window - 1} tokens")


def _mamba_groups(n_groups: int, tp: int) -> int:
    """Mamba2 B/C groups after TP: with groups < tp (or not dividing it) each rank needs whole groups, so SGLang
    extends them to ``tp`` by replication (configs/mamba_utils.py extra_groups_for_head_shards)."""
    return n_groups if n_groups % tp == 0 else n_groups + (tp - n_groups)


# --------------------------------------------------------------------------- DSA's packed index keys

DSA_SCALE_BLOCK = 128
"""SGLang's ``DSATokenToKVPool.quant_block_size`` and vLLM's ``Indexer.quant_block_size``: one float32 scale per
128 fp8 key dims."""


def _dsa_width(f: ModelFacts) -> int:
    """Bytes one token's packed index key takes: fp8 dims plus a float32 scale per block."""
    assert f.indexer is not None
    return f.indexer.head_dim + f.indexer.head_dim // DSA_SCALE_BLOCK * DType.FLOAT32.itemsize


def _dsa_page_check(b: _Builder, where: str) -> None:
    assert b.f.indexer is not None
    hd = b.f.indexer.head_dim
    if b.engine is Engine.SGLANG and hd != DSA_SCALE_BLOCK:
        raise ShapeError(f"{where} asserts index_head_dim == {DSA_SCALE_BLOCK}, got {hd}", "index_head_dim")
    if hd % DSA_SCALE_BLOCK:
        raise ShapeError(f"{where} keeps fp8 index keys with a float32 scale per {DSA_SCALE_BLOCK} dims; "
                         f"index_head_dim {hd} is not a multiple (DeepSeek-V3.2: 128)", "index_head_dim")
    if b.engine is Engine.SGLANG and b.page != 64:
        raise ShapeError(f"{where} needs 64-token pages for DSA (it asserts physical_page_size == 64), got "
                         f"{b.page}", "pageSize")


# --------------------------------------------------------------------------- SGLang 0.5.23


def _sglang(b: _Builder) -> None:
    f, tp = b.f, b.tp
    conv_dtype = DType.BFLOAT16  # mamba2_state_dtype: SGLANG_MAMBA_CONV_DTYPE, default bfloat16
    attn = f.attention_layers
    if f.mla is not None:
        for layer in attn:
            b.add("MLATokenToKVPool.kv_buffer", layer, Item.PAGE, (b.page, 1, sum(f.mla)), f.dtype,
                  Split.REPLICATED)
        if f.indexer is not None:  # DSATokenToKVPool: the MLA pool plus fp8 index keys with scales, per page
            _dsa_page_check(b, "SGLang 0.5.23's DSATokenToKVPool (memory_pool.py)")
            for layer in attn:
                b.add("DSATokenToKVPool.index_k_with_scale_buffer", layer, Item.PAGE, (b.page * _dsa_width(f),),
                      DType.UINT8, Split.REPLICATED)
            b.notes.append("a DSA index page holds its tokens' fp8 keys, then their float32 scales "
                           "(index_key_cache.py): it moves whole")
    else:
        for name in ("k_buffer", "v_buffer"):
            for layer in attn:
                b.add(f"MHATokenToKVPool.{name}", layer, Item.PAGE, (b.page, b.hpr, f.head_dim), f.dtype, Split.HEADS)
    if f.sliding_window:
        b.notes.append("MistralForCausalLM is not a hybrid-SWA architecture in SGLang (configs/model_config.py:2651 "
                       "is_hybrid_swa_model): every layer keeps full KV")
    ix = f.indexer
    indexed = f.layers_of(INDEXED)
    if ix is not None and indexed:
        ratio = ix.compress_ratio
        if b.page <= 1 or b.page % ratio:
            raise ShapeError(f"QSA needs a page size that is a multiple of indexer_compress_ratio {ratio}, "
                             f"got {b.page} (qsa_kv_pool.py QSATokenToKVPool)", "pageSize")
        for layer in indexed:
            b.add("QSATokenToKVPool.qsa_key_state_buffer_pool", layer, Item.SLOT, (ratio, ix.kv_heads, ix.head_dim),
                  DType.BFLOAT16, Split.REPLICATED)
        b.add("QSATokenToKVPool.qsa_rope_position_buffer", QSA_ROPE_LAYER_ID, Item.SLOT, (ratio, 3), DType.INT64,
              Split.REPLICATED)
        for layer in indexed:
            b.add("QSATokenToKVPool.qsa_compressed_k_buffer_pool", layer, Item.PAGE,
                  (b.page // ratio, ix.kv_heads, ix.head_dim), DType.BFLOAT16, Split.REPLICATED)
    linear, mamba = f.layers_of(LINEAR), f.layers_of(MAMBA)
    if linear:
        la = f.linear
        assert la is not None
        _check_heads("linear_num_key_heads", la.key_heads, tp)
        _check_heads("linear_num_value_heads", la.value_heads, tp)
        for layer in linear:
            b.add("MambaPool.conv", layer, Item.SLOT, (sum(la.groups) // tp, la.conv_kernel - 1), conv_dtype,
                  Split.GROUPS, groups=la.groups)
        for layer in linear:
            b.add("MambaPool.temporal", layer, Item.SLOT, (la.value_heads // tp, la.value_dim, la.key_dim),
                  la.ssm_dtype, Split.DIM)
    if mamba:
        m = f.mamba2
        assert m is not None
        _check_heads("mamba_num_heads", m.heads, tp)
        conv = (m.x_channels + 2 * _mamba_groups(m.n_groups, tp) * m.state_size) // tp
        for layer in mamba:
            b.add("MambaPool.conv", layer, Item.SLOT, (conv, m.conv_kernel - 1), conv_dtype, Split.DIM)
        for layer in mamba:
            b.add("MambaPool.temporal", layer, Item.SLOT, (m.heads // tp, m.head_dim, m.state_size), m.ssm_dtype,
                  Split.DIM)
    if f.ple is not None:
        for layer in f.ple.layers:
            b.add("ShortConvPool.conv_state", layer, Item.SLOT, (f.ple.channels, f.ple.columns), conv_dtype,
                  Split.REPLICATED)
        b.add("NGramPool.context", PLE_NGRAM_LAYER_ID, Item.SLOT, (f.ple.ngram_size - 1,), DType.INT64,
              Split.REPLICATED)
    if linear or mamba:
        b.notes.append("conv is [channels, K-1] sliced on its channel axis (MambaPool conv_window_axis -1); the "
                       "pdfleet layout's conv item is [K-1, channels]: the same bytes per item, a different slicing")


# --------------------------------------------------------------------------- vLLM 0.33.0


def _vllm(b: _Builder) -> None:
    """vLLM 0.33.0: one KV-cache spec per layer (``v1/kv_cache_interface.py``); a block of ``page`` tokens for
    attention, one state per request for Mamba layers (``MambaSpec`` shapes from the model class's
    ``get_mamba_state_shape_from_config``, ``model_executor/layers/mamba/mamba_utils.py``)."""
    f, tp = b.f, b.tp
    for layer in f.attention_layers:
        if f.mla is not None:
            b.add("MLAAttentionSpec", layer, Item.PAGE, (b.page, 1, sum(f.mla)), f.dtype, Split.REPLICATED)
        else:
            name = "SlidingWindowSpec" if f.sliding_window else "FullAttentionSpec"
            b.add(name, layer, Item.PAGE, (2, b.page, b.hpr, f.head_dim), f.dtype, Split.HEADS,
                  max_tokens=f.sliding_window)
    if f.indexer is not None and f.family == "deepseek_v32":  # models/deepseek_v2.py Indexer.k_cache
        _dsa_page_check(b, "vLLM 0.33.0's DeepseekV32IndexerCache (models/deepseek_v2.py)")
        for layer in f.attention_layers:
            b.add("MLAAttentionSpec(indexer)", layer, Item.PAGE, (b.page, 1, _dsa_width(f)), DType.UINT8,
                  Split.REPLICATED)
    if f.family == "qwen4_exp_text":
        b.missing.append("vLLM's Qwen4-Exp QSA indexer caches and n-gram ids (not derived)")
    la, m = f.linear, f.mamba2
    for layer in f.layers_of(LINEAR):
        assert la is not None
        _check_heads("linear_num_key_heads", la.key_heads, tp)
        _check_heads("linear_num_value_heads", la.value_heads, tp)
        # mamba_cache_dtype and mamba_ssm_cache_dtype "auto": the model's dtype for both (gated_delta_net_state_dtype)
        b.add("MambaSpec.conv", layer, Item.SLOT, (la.conv_kernel - 1, sum(la.groups) // tp), f.dtype, Split.GROUPS,
              groups=la.groups)
        b.add("MambaSpec.temporal", layer, Item.SLOT, (la.value_heads // tp, la.value_dim, la.key_dim), f.dtype,
              Split.DIM)
    if f.ple is not None:  # a second Mamba layout (Qwen4ExpForCausalLM.get_mamba_specs_from_config)
        for layer in f.ple.layers:
            b.add("MambaSpec.ple_conv", layer, Item.SLOT, (f.ple.columns, f.ple.channels), f.dtype, Split.REPLICATED)
    for layer in f.layers_of(MAMBA):
        assert m is not None
        _check_heads("mamba_num_heads", m.heads, tp)
        conv = (m.x_channels + 2 * _mamba_groups(m.n_groups, tp) * m.state_size) // tp
        b.add("MambaSpec.conv", layer, Item.SLOT, (m.conv_kernel - 1, conv), f.dtype, Split.DIM)
        b.add("MambaSpec.temporal", layer, Item.SLOT, (m.heads // tp, m.head_dim, m.state_size), m.ssm_dtype,
              Split.DIM)
    if f.layers_of(LINEAR, MAMBA):
        b.notes.append("vLLM raises the attention block size until a block holds a request's Mamba state and pads "
                       "the Mamba page to it (platforms/interface.py _align_hybrid_block_size): the page size here "
                       "is the one asked for, not the aligned one")


# --------------------------------------------------------------------------- the layout pdfleet can say


def _layout(b: _Builder) -> Layout | None:
    """The Layout of the form, or None (``b.missing`` then says why)."""
    f, engine = b.f, b.engine
    if b.missing or not b.out:
        return None
    tf = engine is Engine.TRANSFORMERS
    full = list(f.layers_of(FULL, INDEXED))
    common: dict[str, object] = {"num_layers": len(f.layer_kinds), "dtype": f.dtype, "page_size": b.page}
    index_keys = positions = None
    if tf and f.indexer is not None:  # raw per-token index keys (DynamicIndexedLayer.indexer_keys)
        index_keys = IndexKeysConfig(head_dim=f.indexer.head_dim, heads=f.indexer.kv_heads, dtype=f.dtype)
        if f.layers_of(INDEXED):  # Qwen4-Exp: indexer_position_ids [3, S] int64, request-wide
            positions = PositionsConfig(coordinates=3, dtype=DType.INT64)
    elif f.indexer is not None and f.family == "deepseek_v32":  # SGLang's and vLLM's packed fp8 keys
        index_keys = IndexKeysConfig(head_dim=f.indexer.head_dim, heads=1, dtype=DType.FLOAT8_E4M3FN,
                                     scale_block=DSA_SCALE_BLOCK)
    if f.mla is not None:
        return Layout(**common, full_attention_layers=LayerSet(interval=1), attention_kind=AttentionKind.MLA,
                      kv_heads=1, mla=MLAConfig(kv_lora_rank=f.mla[0], qk_rope_head_dim=f.mla[1]),
                      index_keys=index_keys)
    swa = None
    if f.sliding_window and engine is not Engine.SGLANG:
        window = f.sliding_window - 1 if engine is Engine.TRANSFORMERS else f.sliding_window
        swa = SWAConfig(window=window, layers=LayerSet(ids=list(f.layers_of(SLIDING))))
    elif f.sliding_window:
        full = list(f.attention_layers)
    linear = None
    if f.mamba2 is not None:
        m = f.mamba2
        bc = ConvGroup(heads=m.n_groups, head_dim=m.state_size)
        linear = LinearAttentionConfig(
            num_key_heads=m.n_groups, num_value_heads=m.heads, key_head_dim=m.head_dim, value_head_dim=m.state_size,
            conv_kernel=m.conv_kernel, conv_groups=[ConvGroup(heads=m.heads, head_dim=m.head_dim), bc, bc],
            conv_dtype=DType.BFLOAT16 if engine is Engine.SGLANG else f.dtype, temporal_dtype=m.ssm_dtype)
    if f.linear is not None:
        la = f.linear
        linear = LinearAttentionConfig(
            num_key_heads=la.key_heads, num_value_heads=la.value_heads, key_head_dim=la.key_dim,
            value_head_dim=la.value_dim, conv_kernel=la.conv_kernel,
            conv_dtype=DType.BFLOAT16 if engine is Engine.SGLANG else f.dtype,
            temporal_dtype={Engine.SGLANG: la.ssm_dtype, Engine.VLLM: f.dtype}.get(engine, DType.FLOAT32))
    qsa = ple = None
    if not tf and f.indexer is not None and f.layers_of(INDEXED):
        qsa = QSAConfig(compress_ratio=f.indexer.compress_ratio, index_heads=f.indexer.kv_heads,
                        index_head_dim=f.indexer.head_dim, dtype=DType.BFLOAT16, rope_positions=3,
                        rope_dtype=DType.INT64)
    if f.ple is not None:
        ple = PLEConfig(short_conv_layers=LayerSet(ids=list(f.ple.layers)), short_conv_width=f.ple.channels,
                        short_conv_kernel=f.ple.kernel, short_conv_dilation=f.ple.ngram_size,
                        ngram_context=f.ple.ngram_size - 1, ngram_dtype=DType.INT64, ngram_per_layer=tf,
                        dtype=f.dtype if tf else DType.BFLOAT16)
    every = LayerSet(interval=1) if full == list(range(len(f.layer_kinds))) else LayerSet(ids=full)
    empty = LayerSet(ids=list(f.layers_of(NONE))) if f.layers_of(NONE) else None
    return Layout(**common, full_attention_layers=every, kv_heads=f.kv_heads, head_dim=f.head_dim,
                  linear_attention=linear, qsa=qsa, ple=ple, swa=swa, empty_layers=empty, index_keys=index_keys,
                  positions=positions)


def engine_form(facts: ModelFacts, engine: Engine | str, *, tp: int = 1, page_size: int = 16) -> EngineForm:
    """The buffers one TP rank of ``engine`` holds for the model of ``facts``. Raises ``ShapeError`` when
    ``tp`` cannot split the model's heads (or the page size its QSA ratio)."""
    eng = Engine(engine)
    b = _Builder(facts, eng, tp, page_size)
    {Engine.TRANSFORMERS: _transformers, Engine.SGLANG: _sglang, Engine.VLLM: _vllm}[eng](b)
    layout = _layout(b)
    return EngineForm(eng, facts.family, tp, page_size, tuple(b.out), facts.layers_of(NONE), layout,
                      tuple(b.missing), tuple(b.notes))

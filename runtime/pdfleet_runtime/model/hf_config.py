"""A Hugging Face ``config.json`` -> the state layout the model keeps per request (pure: stdlib and layouts).

The reference engine (docs/reference-engine.md) computes a model from a local directory; its pools must be
the ones that model's cache fills. So the layout comes from the config, for the families whose cache
mapping is built (``FAMILIES``): ``llama`` (MHA/GQA KV), ``qwen3_next`` and ``qwen3_5_text`` (KV on the
full-attention layers, Gated DeltaNet conv and recurrent state on the others), ``deepseek_v3`` (MLA latent
plus rope key); and, through transformers' form in ``model.forms``, ``qwen4_exp_text`` (index keys, positions,
PLE), ``deepseek_v32`` (MLA plus index keys), ``nemotron_h`` (Mamba2 x|B|C) and ``mistral`` (sliding window).
Any size: only the fields that shape the state are read, each bounded.

A preset named beside a config must describe the same state (``layout_for_model``): every field the config
decides (layers, layer kinds, heads and widths, MLA ranks, conv kernel, element types) is compared, and the
first difference raises ``ModelConfigError`` naming the layout field and the config field. The page size is
a serving choice, not the model's: the preset's, or the caller's.

Element types follow what transformers keeps: KV and conv state in the model's dtype, the GDN recurrent
state in float32 (a bf16 model keeps it in float32 too).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pdfleet_runtime.layouts import (
    PRESETS,
    AttentionKind,
    DType,
    LayerSet,
    Layout,
    LinearAttentionConfig,
    MLAConfig,
    UnknownPresetError,
)
from pdfleet_runtime.model.config_values import ModelConfigError, config_dtype
from pdfleet_runtime.model.families import model_facts
from pdfleet_runtime.model.forms import Engine, engine_form

__all__ = [
    "CONFIG_FILE",
    "DEFAULT_PAGE_SIZE",
    "FAMILIES",
    "MAX_CONFIG_BYTES",
    "ModelConfigError",
    "config_dtype",
    "layout_for_model",
    "layout_from_config",
    "read_config",
]

CONFIG_FILE = "config.json"
MAX_CONFIG_BYTES = 1 << 20
"""A config.json larger than this is refused unread (a model directory is input, and bounded)."""
FAMILIES = ("llama", "qwen3_next", "qwen3_5_text", "deepseek_v3", "qwen4_exp_text", "deepseek_v32", "nemotron_h",
            "mistral")
"""``model_type``s whose layout (and whose cache <-> pool mapping, ``rank.cache_pools``) exist."""
DEFAULT_PAGE_SIZE = 16
"""Tokens per KV page when neither a preset nor the caller names one."""
_MAX_DIM = 1 << 16
_MAX_HEADS = 4096


def read_config(model_dir: Path) -> dict[str, Any]:
    """``model_dir/config.json`` parsed; bounded, and an object with a supported ``model_type``."""
    path = Path(model_dir) / CONFIG_FILE
    try:
        size = path.stat().st_size
    except OSError as e:
        raise ModelConfigError(f"cannot read {path}: {e.strerror}; a model directory holds config.json "
                               "(Hugging Face layout)", "config.json") from None
    if size > MAX_CONFIG_BYTES:
        raise ModelConfigError(f"{path} is {size} bytes, above the {MAX_CONFIG_BYTES}-byte bound", "config.json")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelConfigError(f"{path} is not valid JSON: {e}", "config.json") from None
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path} must hold a JSON object, got {type(data).__name__}", "config.json")
    family(data)
    return data


def family(config: Mapping[str, Any]) -> str:
    """The config's ``model_type``, one of ``FAMILIES``."""
    mt = config.get("model_type")
    if mt not in FAMILIES:
        raise ModelConfigError(f"config.json model_type {mt!r} is not one the reference engine computes; "
                               f"supported: {', '.join(FAMILIES)}", "model_type")
    return str(mt)


def _int(config: Mapping[str, Any], name: str, *, hi: int = _MAX_DIM, default: int | None = None) -> int:
    v = config.get(name, default)
    if v is None:
        raise ModelConfigError(f"config.json has no {name} (model_type {config.get('model_type')!r} needs it)", name)
    if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= hi:
        raise ModelConfigError(f"config.json {name} = {v!r}: expected an integer in [1, {hi}]", name)
    return v


def _kv_heads(config: Mapping[str, Any]) -> int:
    heads = _int(config, "num_attention_heads", hi=_MAX_HEADS)
    kv = _int(config, "num_key_value_heads", hi=_MAX_HEADS, default=heads)
    if heads % kv:
        raise ModelConfigError(f"config.json num_attention_heads {heads} is not a multiple of "
                               f"num_key_value_heads {kv}", "num_key_value_heads")
    return kv


def _head_dim(config: Mapping[str, Any]) -> int:
    if config.get("head_dim") is not None:
        return _int(config, "head_dim")
    hidden, heads = _int(config, "hidden_size", hi=1 << 20), _int(config, "num_attention_heads", hi=_MAX_HEADS)
    if hidden % heads:
        raise ModelConfigError(f"config.json hidden_size {hidden} is not a multiple of num_attention_heads {heads} "
                               "(and no head_dim is given)", "head_dim")
    return hidden // heads


def _full_attention_ids(config: Mapping[str, Any], layers: int) -> tuple[int, ...]:
    """Qwen3-Next / Qwen3.5: ``layer_types`` when given, else every ``full_attention_interval``-th layer."""
    types = config.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers:
            raise ModelConfigError(f"config.json layer_types must list {layers} layer kinds (num_hidden_layers)",
                                   "layer_types")
        bad = sorted({t for t in types if t not in ("full_attention", "linear_attention")})
        if bad:
            raise ModelConfigError(f"config.json layer_types holds {bad}: only full_attention and linear_attention "
                                   "are computed", "layer_types")
        return tuple(i for i, t in enumerate(types) if t == "full_attention")
    every = _int(config, "full_attention_interval", hi=layers)
    return tuple(i for i in range(layers) if (i + 1) % every == 0)


_FROM_FORMS = ("qwen4_exp_text", "deepseek_v32", "nemotron_h", "mistral")


def layout_from_config(config: Mapping[str, Any], *, page_size: int = DEFAULT_PAGE_SIZE) -> Layout:
    """The layout of the state the model of ``config`` (a parsed config.json) keeps per request."""
    fam = family(config)
    if fam in _FROM_FORMS:  # transformers' form (model.forms): index keys, positions, PLE, Mamba2 conv groups
        form = engine_form(model_facts(config), Engine.TRANSFORMERS, page_size=page_size)
        assert form.layout is not None, form.missing
        return form.layout
    layers = _int(config, "num_hidden_layers", hi=4096)
    dtype = config_dtype(config)
    common: dict[str, Any] = {"num_layers": layers, "dtype": dtype, "page_size": page_size}
    try:
        if fam == "llama":
            return Layout(**common, full_attention_layers=LayerSet(interval=1), kv_heads=_kv_heads(config),
                          head_dim=_head_dim(config))
        if fam == "deepseek_v3":
            return Layout(**common, full_attention_layers=LayerSet(interval=1), attention_kind=AttentionKind.MLA,
                          kv_heads=1, mla=MLAConfig(kv_lora_rank=_int(config, "kv_lora_rank"),
                                                    qk_rope_head_dim=_int(config, "qk_rope_head_dim")))
        full = _full_attention_ids(config, layers)
        linear = LinearAttentionConfig(
            num_key_heads=_int(config, "linear_num_key_heads", hi=_MAX_HEADS),
            num_value_heads=_int(config, "linear_num_value_heads", hi=_MAX_HEADS),
            key_head_dim=_int(config, "linear_key_head_dim"), value_head_dim=_int(config, "linear_value_head_dim"),
            conv_kernel=_int(config, "linear_conv_kernel_dim", hi=64), conv_dtype=dtype,
            temporal_dtype=DType.FLOAT32)
        if linear.num_value_heads % linear.num_key_heads:
            raise ModelConfigError(f"config.json linear_num_value_heads {linear.num_value_heads} is not a multiple "
                                   f"of linear_num_key_heads {linear.num_key_heads}", "linear_num_value_heads")
        return Layout(**common, full_attention_layers=LayerSet(ids=list(full)), kv_heads=_kv_heads(config),
                      head_dim=_head_dim(config), linear_attention=linear)
    except ValueError as e:  # pydantic's, from Layout itself
        if isinstance(e, ModelConfigError):
            raise
        raise ModelConfigError(f"config.json of model_type {fam} gives no servable layout: {e}", "config.json") from e


# layout field (camelCase, as the CRD names it) -> the config.json field that decides it
_FIELDS: tuple[tuple[str, str], ...] = (
    ("numLayers", "num_hidden_layers"),
    ("fullAttentionLayers", "layer_types / full_attention_interval"),
    ("attentionKind", "model_type"),
    ("kvHeads", "num_key_value_heads"),
    ("headDim", "head_dim"),
    ("mla.kvLoraRank", "kv_lora_rank"),
    ("mla.qkRopeHeadDim", "qk_rope_head_dim"),
    ("dtype", "dtype"),
    ("linearAttention", "linear_num_key_heads"),
    ("linearAttention.numKeyHeads", "linear_num_key_heads"),
    ("linearAttention.numValueHeads", "linear_num_value_heads"),
    ("linearAttention.keyHeadDim", "linear_key_head_dim"),
    ("linearAttention.valueHeadDim", "linear_value_head_dim"),
    ("linearAttention.convKernel", "linear_conv_kernel_dim"),
    ("linearAttention.convDtype", "dtype"),
    ("linearAttention.temporalDtype", "dtype"),
    ("swa", "sliding_window"),
    ("qsa", "model_type"),
    ("ple", "model_type"),
)


def _value(lay: Layout, field: str) -> object:
    if field == "fullAttentionLayers":
        return lay.full_attention_layer_ids
    obj: object = lay
    for part in field.split("."):
        if obj is None:
            return None
        snake = "".join(f"_{c.lower()}" if c.isupper() else c for c in part)
        obj = getattr(obj, snake)
    if isinstance(obj, LinearAttentionConfig):
        return "present"
    return obj.value if hasattr(obj, "value") else obj


def layout_for_model(config: Mapping[str, Any], declared: str | Layout | None = None, *,
                     page_size: int | None = None) -> Layout:
    """The layout to serve ``config`` with: the declared one (a preset name, or a layout given in full, as a
    runtime config's ``layout`` names it) after checking that it describes exactly the config's state, else
    the layout derived from the config (``page_size`` or the default).

    Raises ``ModelConfigError`` naming the first field where the declared layout and the config disagree, and
    ``UnknownPresetError`` for a preset that does not exist.
    """
    if declared is None:
        return layout_from_config(config, page_size=page_size or DEFAULT_PAGE_SIZE)
    if isinstance(declared, str):
        if declared not in PRESETS:
            raise UnknownPresetError(declared, PRESETS)
        named, what = PRESETS[declared], f"layout preset {declared!r}"
    else:
        named, what = declared, "the inline layout"
    derived = layout_from_config(config, page_size=named.page_size)
    for field, config_field in _FIELDS:
        want, got = _value(named, field), _value(derived, field)
        if want != got:
            raise ModelConfigError(
                f"{what} disagrees with config.json at {field}: the layout says {want!r}, config.json "
                f"({config_field}) implies {got!r}; name no preset (the layout then comes from config.json) or one "
                "that matches the model", field)
    return named

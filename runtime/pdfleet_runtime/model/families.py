"""A model's state-shaping facts read from its ``config.json`` (pure: stdlib only), for every family
``pdfleet layout`` knows, whatever engine then stores the state (``model.forms``).

One ``ModelFacts`` per config: the layer kinds (``full_attention``, ``sliding_attention``,
``linear_attention`` for GDN, ``mamba`` for Mamba2, ``indexed_attention`` for Qwen4-Exp's QSA layers,
``none`` for MLP-only layers), the attention heads, the linear-attention or Mamba2 sizes, MLA ranks, the
DSA / QSA indexer and Qwen4-Exp's PLE. Each value is bounded; a missing or bad one raises
``ModelConfigError`` naming the config field. Multimodal wrappers (``qwen4_exp``) are read through their
``text_config``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdfleet_runtime.layouts import DType
from pdfleet_runtime.model.config_values import ModelConfigError, config_dtype

__all__ = [
    "FULL",
    "INDEXED",
    "KNOWN_FAMILIES",
    "LINEAR",
    "MAMBA",
    "NONE",
    "SLIDING",
    "IndexerFacts",
    "LinearFacts",
    "Mamba2Facts",
    "ModelFacts",
    "PLEFacts",
    "model_facts",
    "text_config",
]

FULL, SLIDING, LINEAR, MAMBA, INDEXED, NONE = (
    "full_attention", "sliding_attention", "linear_attention", "mamba", "indexed_attention", "none")
KNOWN_FAMILIES = ("llama", "mistral", "qwen3_next", "qwen3_5_text", "qwen4_exp_text", "deepseek_v3",
                  "deepseek_v32", "nemotron_h")
"""``model_type``s ``pdfleet layout`` reads (``qwen4_exp`` is read through its ``text_config``)."""
_MAX_DIM = 1 << 20
_MAX_HEADS = 4096


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's config: ``text_config`` of a multimodal wrapper, else the config itself."""
    inner = config.get("text_config")
    if config.get("model_type") == "qwen4_exp" and isinstance(inner, dict):
        return {"model_type": "qwen4_exp_text", **inner}
    return config


def _int(cfg: Mapping[str, Any], name: str, *, hi: int = _MAX_DIM, default: int | None = None, lo: int = 1) -> int:
    v = cfg.get(name, default)
    if v is None:
        raise ModelConfigError(f"config.json has no {name} (model_type {cfg.get('model_type')!r} needs it)", name)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ModelConfigError(f"config.json {name} = {v!r}: expected an integer in [{lo}, {hi}]", name)
    return v


@dataclass(frozen=True)
class LinearFacts:
    """Gated DeltaNet: conv channels q | k | v, recurrent state ``[value heads, key dim, value dim]``."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int
    ssm_dtype: DType  # config ``mamba_ssm_dtype`` (SGLang reads it); float32 otherwise

    @property
    def groups(self) -> tuple[int, int, int]:
        qk = self.key_heads * self.key_dim
        return (qk, qk, self.value_heads * self.value_dim)


@dataclass(frozen=True)
class Mamba2Facts:
    """Mamba2 (NemotronH): conv channels x | B | C (B and C ``n_groups`` groups of ``state_size``), SSM
    ``[heads, head_dim, state_size]``."""

    heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int
    ssm_dtype: DType

    @property
    def x_channels(self) -> int:
        return self.heads * self.head_dim


@dataclass(frozen=True)
class IndexerFacts:
    """A sparse-attention indexer's keys: DSA (DeepSeek-V3.2) or Qwen4-Exp's compressed QSA."""

    head_dim: int
    kv_heads: int = 1
    compress_ratio: int = 1  # QSA only


@dataclass(frozen=True)
class PLEFacts:
    """Qwen4-Exp per-layer embeddings: a dilated short conv ``[hc_count x hidden, (K-1) x ngram_size]`` and the
    last ``ngram_size - 1`` token ids, on the (0-based) ``layers``."""

    layers: tuple[int, ...]
    channels: int
    kernel: int
    ngram_size: int

    @property
    def columns(self) -> int:
        return (self.kernel - 1) * self.ngram_size


@dataclass(frozen=True)
class ModelFacts:
    """What shapes a model's per-request state, read from its config.json."""

    family: str
    dtype: DType
    layer_kinds: tuple[str, ...]
    kv_heads: int = 1
    head_dim: int = 0
    sliding_window: int | None = None
    mla: tuple[int, int] | None = None  # (kv_lora_rank, qk_rope_head_dim)
    linear: LinearFacts | None = None
    mamba2: Mamba2Facts | None = None
    indexer: IndexerFacts | None = None
    ple: PLEFacts | None = None

    def layers_of(self, *kinds: str) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k in kinds)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return self.layers_of(FULL, SLIDING, INDEXED)


def _kv(cfg: Mapping[str, Any]) -> tuple[int, int]:
    heads = _int(cfg, "num_attention_heads", hi=_MAX_HEADS)
    kv = _int(cfg, "num_key_value_heads", hi=_MAX_HEADS, default=heads)
    if heads % kv:
        raise ModelConfigError(f"config.json num_attention_heads {heads} is not a multiple of num_key_value_heads "
                               f"{kv}", "num_key_value_heads")
    if cfg.get("head_dim") is not None:
        return kv, _int(cfg, "head_dim")
    hidden = _int(cfg, "hidden_size")
    if hidden % heads:
        raise ModelConfigError(f"config.json hidden_size {hidden} is not a multiple of num_attention_heads {heads} "
                               "(and no head_dim is given)", "head_dim")
    return kv, hidden // heads


def _ssm_dtype(cfg: Mapping[str, Any], name: str) -> DType:
    raw = cfg.get(name) or "float32"
    try:
        return DType(raw)
    except ValueError:
        raise ModelConfigError(f"config.json {name} {raw!r} is not a known dtype", name) from None


_KIND_ALIASES = {"full_attention": FULL, "attention": FULL, "qwen_sparse_attention": INDEXED,
                 "indexed_attention": INDEXED, "linear_attention": LINEAR, "sliding_attention": SLIDING,
                 "mamba": MAMBA, "mlp": NONE, "moe": NONE}
_PATTERN = {"M": MAMBA, "*": FULL, "-": NONE, "E": NONE}


def _layer_types(cfg: Mapping[str, Any], layers: int, *, default_full: str = FULL) -> tuple[str, ...]:
    types = cfg.get("layer_types")
    if types is None:
        every = _int(cfg, "full_attention_interval", hi=layers, default=4)
        return tuple(default_full if (i + 1) % every == 0 else LINEAR for i in range(layers))
    if not isinstance(types, list) or len(types) != layers:
        raise ModelConfigError(f"config.json layer_types must list {layers} layer kinds (num_hidden_layers)",
                               "layer_types")
    bad = sorted({str(t) for t in types if t not in _KIND_ALIASES})
    if bad:
        raise ModelConfigError(f"config.json layer_types holds {bad}: known kinds are {sorted(_KIND_ALIASES)}",
                               "layer_types")
    return tuple(_KIND_ALIASES[t] for t in types)


def _linear(cfg: Mapping[str, Any]) -> LinearFacts:
    lin = LinearFacts(
        key_heads=_int(cfg, "linear_num_key_heads", hi=_MAX_HEADS),
        value_heads=_int(cfg, "linear_num_value_heads", hi=_MAX_HEADS),
        key_dim=_int(cfg, "linear_key_head_dim"), value_dim=_int(cfg, "linear_value_head_dim"),
        conv_kernel=_int(cfg, "linear_conv_kernel_dim", hi=64), ssm_dtype=_ssm_dtype(cfg, "mamba_ssm_dtype"))
    if lin.value_heads % lin.key_heads:
        raise ModelConfigError(f"config.json linear_num_value_heads {lin.value_heads} is not a multiple of "
                               f"linear_num_key_heads {lin.key_heads}", "linear_num_value_heads")
    return lin


def _qwen4(cfg: Mapping[str, Any], layers: int) -> dict[str, Any]:
    kinds = list(_layer_types(cfg, layers, default_full=INDEXED))
    out: dict[str, Any] = {"linear": _linear(cfg)}
    if cfg.get("indexer_n_heads") is not None:
        kinds = [INDEXED if k == FULL else k for k in kinds]
        out["indexer"] = IndexerFacts(head_dim=_int(cfg, "indexer_head_dim"),
                                      kv_heads=_int(cfg, "indexer_kv_heads", hi=_MAX_HEADS),
                                      compress_ratio=_int(cfg, "indexer_compress_ratio", hi=1024))
    else:
        kinds = [FULL if k == INDEXED else k for k in kinds]
    ple_ids = cfg.get("ple_layer_ids") or []
    if not isinstance(ple_ids, list) or any(not isinstance(i, int) or not 1 <= i <= layers for i in ple_ids):
        raise ModelConfigError(f"config.json ple_layer_ids must list one-based layer ids in [1, {layers}]",
                               "ple_layer_ids")
    if ple_ids:
        hidden = _int(cfg, "hidden_size")
        out["ple"] = PLEFacts(layers=tuple(sorted({i - 1 for i in ple_ids})),
                              channels=_int(cfg, "hc_count", default=4, lo=2, hi=64) * hidden,
                              kernel=_int(cfg, "ple_conv_kernel_size", default=4, lo=2, hi=64),
                              ngram_size=_int(cfg, "ngram_size", default=3, lo=2, hi=64))
    out["layer_kinds"] = tuple(kinds)
    return out


def _nemotron_h(cfg: Mapping[str, Any]) -> dict[str, Any]:
    types = cfg.get("layers_block_type") or cfg.get("layer_types")
    if types is None and isinstance(cfg.get("hybrid_override_pattern"), str):
        pattern = cfg["hybrid_override_pattern"]
        if set(pattern) - set(_PATTERN):
            raise ModelConfigError(f"config.json hybrid_override_pattern {pattern!r} holds characters other than "
                                   "M * - E", "hybrid_override_pattern")
        kinds = tuple(_PATTERN[c] for c in pattern)
    elif isinstance(types, list) and all(t in _KIND_ALIASES for t in types):
        kinds = tuple(_KIND_ALIASES[t] if t != "linear_attention" else MAMBA for t in types)
    else:
        raise ModelConfigError("config.json of nemotron_h needs hybrid_override_pattern or layers_block_type",
                               "hybrid_override_pattern")
    return {"layer_kinds": kinds, "mamba2": Mamba2Facts(
        heads=_int(cfg, "mamba_num_heads", hi=_MAX_HEADS), head_dim=_int(cfg, "mamba_head_dim"),
        n_groups=_int(cfg, "n_groups", hi=_MAX_HEADS), state_size=_int(cfg, "ssm_state_size"),
        conv_kernel=_int(cfg, "conv_kernel", hi=64), ssm_dtype=_ssm_dtype(cfg, "mamba_ssm_cache_dtype"))}


def model_facts(config: Mapping[str, Any]) -> ModelFacts:
    """The state-shaping facts of ``config`` (a parsed config.json) of a family in ``KNOWN_FAMILIES``."""
    cfg = text_config(config)
    fam = cfg.get("model_type")
    if fam not in KNOWN_FAMILIES:
        raise ModelConfigError(f"config.json model_type {fam!r} has no layout in pdfleet; known: "
                               f"{', '.join(KNOWN_FAMILIES)} (and qwen4_exp)", "model_type")
    dtype = config_dtype(cfg if ("dtype" in cfg or "torch_dtype" in cfg) else config)
    if fam == "nemotron_h":
        kv, hd = _kv(cfg)
        return ModelFacts(family=fam, dtype=dtype, kv_heads=kv, head_dim=hd, **_nemotron_h(cfg))
    layers = _int(cfg, "num_hidden_layers", hi=4096)
    if fam in ("deepseek_v3", "deepseek_v32"):
        mla = (_int(cfg, "kv_lora_rank"), _int(cfg, "qk_rope_head_dim"))
        indexer = IndexerFacts(head_dim=_int(cfg, "index_head_dim", default=128)) if fam == "deepseek_v32" else None
        return ModelFacts(family=fam, dtype=dtype, layer_kinds=(FULL,) * layers, mla=mla, indexer=indexer)
    kv, hd = _kv(cfg)
    if fam in ("llama", "mistral"):
        window = cfg.get("sliding_window") if fam == "mistral" else None
        if window is not None:
            window = _int(cfg, "sliding_window", hi=1 << 24, lo=2)
        kinds = (SLIDING if window else FULL,) * layers
        return ModelFacts(family=fam, dtype=dtype, layer_kinds=kinds, kv_heads=kv, head_dim=hd, sliding_window=window)
    if fam == "qwen4_exp_text":
        return ModelFacts(family=fam, dtype=dtype, kv_heads=kv, head_dim=hd, **_qwen4(cfg, layers))
    return ModelFacts(family=fam, dtype=dtype, layer_kinds=_layer_types(cfg, layers), kv_heads=kv, head_dim=hd,
                      linear=_linear(cfg))

"""The layout schema: enums, errors and the pydantic models of a model's per-request state (pure).

``Layout`` and its parts become the CRD's ``spec.model.layout.inline`` (their descriptions are the ``kubectl
explain`` text). ``layouts`` re-exports every name here beside the presets and the per-rank derivation; import
from ``layouts``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

__all__ = [
    "AttentionKind",
    "ConvGroup",
    "DType",
    "EntryField",
    "IndexKeysConfig",
    "IndexKind",
    "LayerSet",
    "Layout",
    "LayoutError",
    "LinearAttentionConfig",
    "MLAConfig",
    "PLEConfig",
    "PositionsConfig",
    "QSAConfig",
    "SWAConfig",
    "ShapeError",
    "Sharding",
    "StateType",
    "UnknownPresetError",
]


# --------------------------------------------------------------------------- enums


class StateType(StrEnum):
    """State type names used across the project (design.md section 1)."""

    KV = "kv"
    SWA = "swa"
    MAMBA = "mamba"
    QSA_PENDING = "qsa_pending"
    QSA_COMPRESSED = "qsa_compressed"
    PLE_SHORT_CONV = "ple_short_conv"
    PLE_NGRAM = "ple_ngram"
    INDEX_K = "index_k"
    POSITIONS = "positions"


class AttentionKind(StrEnum):
    """Full-attention KV form: MHA/GQA keeps K and V per head; MLA keeps one latent entry."""

    MHA = "MHA"
    MLA = "MLA"


class DType(StrEnum):
    """Element types of state buffers (torch names)."""

    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT32 = "float32"
    FLOAT8_E4M3FN = "float8_e4m3fn"
    INT32 = "int32"
    INT64 = "int64"
    UINT8 = "uint8"  # bytes of a packed form (fp8 index keys with their scales)

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return _DTYPE_BYTES[self]


_DTYPE_BYTES = {
    DType.BFLOAT16: 2,
    DType.FLOAT16: 2,
    DType.FLOAT32: 4,
    DType.FLOAT8_E4M3FN: 1,
    DType.INT32: 4,
    DType.INT64: 8,
    DType.UINT8: 1,
}


class EntryField(StrEnum):
    """Which tensor of a state type a buffer is; pairing groups by (state type, field)."""

    K = "k"
    V = "v"
    LATENT = "latent"
    CONV = "conv"
    TEMPORAL = "temporal"
    PENDING = "pending"
    ROPE = "rope"
    COMPRESSED = "compressed"
    SHORT_CONV = "short_conv"
    NGRAM = "ngram"
    INDEX_K = "index_k"
    POSITIONS = "positions"


class IndexKind(StrEnum):
    """What a request names in a buffer: KV pages (shared by QSA compressed), SWA pages, slots, rows."""

    PAGE = "page"
    SWA_PAGE = "swa_page"
    SLOT = "slot"
    ROW = "row"


class Sharding(StrEnum):
    """How a buffer splits across TP ranks."""

    REPLICATED = "replicated"  # every rank holds the whole item
    DIM = "dim"  # one sliceable dim, optionally in shard groups
    HEADS = "heads"  # KV heads: sliced, or replicated when tp > heads


# --------------------------------------------------------------------------- errors


class LayoutError(ValueError):
    """A layout, preset reference or rank shape that cannot be served."""


class UnknownPresetError(LayoutError):
    """A ``LayoutRef`` names a preset that does not exist."""

    def __init__(self, name: str, known: Iterable[str]) -> None:
        self.name = name
        self.known = tuple(sorted(known))
        super().__init__(f"unknown layout preset {name!r}; known presets: {', '.join(self.known)}")


class ShapeError(LayoutError):
    """A (tp, pp) shape the layout cannot be split into; ``field`` names the offending setting."""

    def __init__(self, message: str, field: str) -> None:
        self.field = field
        super().__init__(message)


# --------------------------------------------------------------------------- models


class _Model(BaseModel):
    model_config = ConfigDict(
        frozen=True, extra="forbid", alias_generator=to_camel, populate_by_name=True
    )


class LayerSet(_Model):
    """A set of global layer ids: an explicit list, or every ``interval``-th layer from ``offset``."""

    ids: list[int] | None = Field(
        default=None, description="Explicit global layer ids (0-based). Exclusive with interval."
    )
    interval: int | None = Field(
        default=None,
        ge=1,
        description="Select layer i when i % interval == offset (Qwen3-Next: interval 4, offset 3).",
    )
    offset: int = Field(default=0, ge=0, description="Offset for interval selection; default 0.")

    @model_validator(mode="after")
    def _one_form(self) -> LayerSet:
        if (self.ids is None) == (self.interval is None):
            raise ValueError("exactly one of ids or interval must be set")
        if self.ids is not None:
            if any(i < 0 for i in self.ids) or len(set(self.ids)) != len(self.ids):
                raise ValueError(f"ids must be distinct and non-negative, got {self.ids}")
        elif self.interval is not None and self.offset >= self.interval:
            raise ValueError(f"offset {self.offset} must be below interval {self.interval}")
        return self

    def resolve(self, num_layers: int) -> tuple[int, ...]:
        """The sorted layer ids, all below ``num_layers``."""
        if self.ids is not None:
            return tuple(sorted(self.ids))
        assert self.interval is not None
        return tuple(i for i in range(num_layers) if i % self.interval == self.offset)


class MLAConfig(_Model):
    """MLA latent KV: one entry per layer of ``kvLoraRank + qkRopeHeadDim`` values per token."""

    kv_lora_rank: int = Field(ge=1, description="Width of the compressed latent KV (DeepSeek-V3: 512).")
    qk_rope_head_dim: int = Field(ge=0, description="Width of the decoupled RoPE key (DeepSeek-V3: 64).")


class ConvGroup(_Model):
    """One channel group of a linear-attention conv state: ``heads`` x ``headDim`` channels.

    Under TP a group is sharded when TP divides its heads, and replicated on ``tp / heads`` ranks (each
    holding one head) when its heads divide TP: Mamba2's B and C with ``n_groups`` below TP. The planner
    slices each group on its own and elects one writer among the replicas of a head."""

    heads: int = Field(ge=1, le=4096, description="Heads (groups) of this channel group.")
    head_dim: int = Field(ge=1, le=1 << 20, description="Channels per head.")

    @property
    def width(self) -> int:
        return self.heads * self.head_dim

    def per_rank(self, tp: int) -> int:
        """Channels one rank of ``tp`` holds: its share of the heads, or one whole head when replicated."""
        return self.width // tp if self.heads % tp == 0 else self.head_dim


class LinearAttentionConfig(_Model):
    """Linear attention (Gated DeltaNet style) on every layer that is neither full attention nor SWA."""

    num_key_heads: int = Field(ge=1, description="Key (and query) heads; sharded across TP.")
    num_value_heads: int = Field(ge=1, description="Value heads; the temporal state is sharded by these.")
    key_head_dim: int = Field(ge=1, description="Per-head key width.")
    value_head_dim: int = Field(ge=1, description="Per-head value width.")
    conv_kernel: int = Field(
        ge=2, description="Causal conv kernel; the conv state keeps conv_kernel - 1 columns per channel."
    )
    conv_dtype: DType = Field(default=DType.BFLOAT16, description="Conv state element type.")
    temporal_dtype: DType = Field(
        default=DType.FLOAT32, description="Temporal (recurrent) state element type; default float32."
    )
    conv_groups: list[ConvGroup] | None = Field(
        default=None, min_length=1, max_length=16,
        description="The conv state's channel groups in order, when they are not Gated DeltaNet's q|k|v (the "
        "default: numKeyHeads x keyHeadDim twice, numValueHeads x valueHeadDim). Mamba2: x (heads x head dim), "
        "then B and C (n_groups x state size each); a group whose heads are fewer than TP is replicated.",
    )

    @property
    def groups(self) -> tuple[ConvGroup, ...]:
        """The conv channel groups: declared, or q | k | v."""
        if self.conv_groups is not None:
            return tuple(self.conv_groups)
        qk = ConvGroup(heads=self.num_key_heads, head_dim=self.key_head_dim)
        return (qk, qk, ConvGroup(heads=self.num_value_heads, head_dim=self.value_head_dim))

    @property
    def conv_shard_groups(self) -> tuple[int, ...]:
        """Global channel widths of the conv state's groups (q, k, v by default), each sliced on its own."""
        return tuple(g.width for g in self.groups)


class QSAConfig(_Model):
    """QSA: compressed index keys for sparse attention on the full-attention layers."""

    compress_ratio: int = Field(ge=1, description="Tokens per compressed entry; must divide pageSize.")
    index_heads: int = Field(ge=1, description="Index-key heads per token (replicated on every rank).")
    index_head_dim: int = Field(ge=1, description="Width of one index-key head.")
    dtype: DType = Field(default=DType.BFLOAT16, description="Index-key element type.")
    rope_positions: int = Field(
        default=1, ge=1, le=8,
        description="Position coordinates kept per pending token in the RoPE ring (SGLang 0.5.23 keeps 3: MRoPE).",
    )
    rope_dtype: DType = Field(default=DType.INT32, description="RoPE ring element type (SGLang 0.5.23: int64).")


class PLEConfig(_Model):
    """Per-layer embeddings with a short causal conv per layer and an n-gram token history."""

    short_conv_layers: LayerSet = Field(description="Layers with PLE short-conv state.")
    short_conv_width: int = Field(ge=1, description="Channels of the per-layer embedding conv.")
    short_conv_kernel: int = Field(ge=2, description="Conv kernel; the state keeps kernel - 1 columns.")
    ngram_context: int = Field(ge=1, description="Token ids of history kept per request.")
    dtype: DType = Field(default=DType.BFLOAT16, description="Short-conv state element type.")
    short_conv_dilation: int = Field(
        default=1, ge=1, le=64,
        description="Conv dilation: the state keeps (kernel - 1) x dilation columns (Qwen4-Exp: its ngram_size).",
    )
    ngram_dtype: DType = Field(default=DType.INT32, description="N-gram history element type (SGLang 0.5.23: int64).")
    ngram_per_layer: bool = Field(
        default=False,
        description="Keep the n-gram history on every PLE layer (transformers 5.23.0's conv_states[2]) instead of "
        "once per request.",
    )

    @property
    def short_conv_columns(self) -> int:
        """Columns of the short-conv state: (kernel - 1) x dilation."""
        return (self.short_conv_kernel - 1) * self.short_conv_dilation


class IndexKeysConfig(_Model):
    """Per-token index keys of a sparse-attention indexer, paged like KV, replicated on every TP rank (one index
    head): raw (transformers' Qwen4-Exp QSA and DeepSeek-V3.2 DSA ``indexer_keys``), or fp8 with one float32
    scale per ``scaleBlock`` dims, a page holding its tokens' keys then their scales (SGLang 0.5.23's
    ``DSATokenToKVPool.index_k_with_scale_buffer``, vLLM 0.33.0's ``DeepseekV32IndexerCache``): a page moves
    whole, as the uint8 bytes both engines register."""

    head_dim: int = Field(ge=1, le=1 << 16, description="Width of one index key.")
    heads: int = Field(default=1, ge=1, le=64, description="Index key heads per token (transformers: 1).")
    dtype: DType = Field(default=DType.BFLOAT16, description="Index key element type.")
    layers: LayerSet | None = Field(default=None, description="Layers holding index keys; default the full-attention "
                                    "layers.")
    scale_block: int | None = Field(
        default=None, ge=1, le=1 << 16,
        description="fp8 keys quantized in blocks of this many dims, one float32 scale per block, stored after the "
        "page's keys (SGLang's and vLLM's DSA: 128); needs dtype float8_e4m3fn. Unset: raw keys.")

    @model_validator(mode="after")
    def _scaled(self) -> IndexKeysConfig:
        if self.scale_block is not None:
            if self.dtype is not DType.FLOAT8_E4M3FN:
                raise ValueError(f"indexKeys.scaleBlock needs dtype float8_e4m3fn (got {self.dtype.value}); "
                                 "unset scaleBlock for raw keys")
            if self.head_dim % self.scale_block:
                raise ValueError(f"indexKeys.headDim {self.head_dim} is not a multiple of scaleBlock "
                                 f"{self.scale_block}")
        return self

    @property
    def token_shape(self) -> tuple[tuple[int, ...], DType]:
        """One token's buffer shape and dtype: ``[heads, headDim]`` raw, or ``[heads, headDim + scales x 4]``
        bytes when scaled."""
        if self.scale_block is None:
            return (self.heads, self.head_dim), self.dtype
        return (self.heads, self.head_dim + self.head_dim // self.scale_block * DType.FLOAT32.itemsize), DType.UINT8


class PositionsConfig(_Model):
    """A request-wide per-token position buffer (transformers' Qwen4-Exp ``indexer_position_ids`` ``[3, S]``),
    paged like KV, held by every PP stage that holds an index-key layer; one elected stage sends it."""

    coordinates: int = Field(default=3, ge=1, le=8, description="Coordinates per token (MRoPE: 3).")
    dtype: DType = Field(default=DType.INT64, description="Element type.")


class SWAConfig(_Model):
    """Sliding-window attention layers: K and V pages of the last ``window`` tokens, sharded as KV."""

    window: int = Field(ge=1, description="Window in tokens.")
    layers: LayerSet = Field(description="SWA layers; disjoint from the full-attention layers.")


class Layout(_Model):
    """The state a model keeps per request, enough to size pools and plan transfers."""

    num_layers: int = Field(ge=1, le=4096, description="Number of decoder layers.")
    full_attention_layers: LayerSet = Field(description="Layers with full attention (paged KV).")
    attention_kind: AttentionKind = Field(default=AttentionKind.MHA, description="MHA (K and V) or MLA.")
    kv_heads: int = Field(ge=1, description="KV heads of full attention; 1 for MLA (one latent head).")
    head_dim: int | None = Field(
        default=None, ge=1, description="Per-head K/V width for MHA; omitted for MLA (see mla)."
    )
    mla: MLAConfig | None = Field(default=None, description="MLA latent dims; required iff MLA.")
    dtype: DType = Field(default=DType.BFLOAT16, description="KV cache element type.")
    page_size: int = Field(ge=1, description="Tokens per KV page.")
    linear_attention: LinearAttentionConfig | None = Field(
        default=None, description="Linear attention on the layers that are neither full nor SWA."
    )
    qsa: QSAConfig | None = Field(default=None, description="QSA state on the full-attention layers.")
    ple: PLEConfig | None = Field(default=None, description="Per-layer-embedding state.")
    swa: SWAConfig | None = Field(default=None, description="Sliding-window attention layers.")
    index_keys: IndexKeysConfig | None = Field(default=None, description="Raw per-token index keys.")
    positions: PositionsConfig | None = Field(
        default=None, description="Request-wide per-token positions (needs indexKeys).")
    empty_layers: LayerSet | None = Field(
        default=None,
        description="Layers that hold no per-request state (NemotronH's MLP-only layers); never linear attention.",
    )
    weight_bytes: int | None = Field(
        default=None, ge=0,
        description="Bytes of the model's weights (pdfleet layout fills it from config.json); the GPU memory rule "
        "counts weightBytes / (tensor x pipeline) per rank beside the pools. Unset: pools alone.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> Layout:
        n = self.num_layers
        full = self.full_attention_layers.resolve(n)
        empty = set(self.empty_layers.resolve(n)) if self.empty_layers else set()
        for name, ids in (("fullAttentionLayers", full),
                          ("emptyLayers", tuple(empty)),
                          ("swa.layers", self.swa.layers.resolve(n) if self.swa else ()),
                          ("ple.shortConvLayers", self.ple.short_conv_layers.resolve(n) if self.ple else ())):
            bad = [i for i in ids if i >= n]
            if bad:
                raise ValueError(f"{name}: layer ids {bad} are not below numLayers {n}")
        if self.attention_kind is AttentionKind.MHA:
            if self.head_dim is None or self.mla is not None:
                raise ValueError("MHA needs headDim and no mla")
        elif self.mla is None or self.head_dim is not None or self.kv_heads != 1 or self.swa is not None:
            raise ValueError("MLA needs mla, kvHeads 1, no headDim and no swa")
        swa = set(self.swa.layers.resolve(n)) if self.swa else set()
        if swa & set(full):
            raise ValueError(f"layers {sorted(swa & set(full))} are both full attention and SWA")
        if empty & (swa | set(full)):
            raise ValueError(f"layers {sorted(empty & (swa | set(full)))} are both empty and attention layers")
        if self.linear_attention is None and len(full) + len(swa) + len(empty) != n:
            missing = sorted(set(range(n)) - set(full) - swa - empty)
            raise ValueError(f"layers {missing} have no attention (set linearAttention or list them)")
        if self.positions is not None and self.index_keys is None:
            raise ValueError("positions needs indexKeys (they are held where the index keys are)")
        bad_ix = sorted(set(self.index_key_layer_ids) - set(full))
        if bad_ix:
            raise ValueError(f"indexKeys.layers {bad_ix} are not full-attention layers")
        if self.qsa is not None and self.page_size % self.qsa.compress_ratio:
            raise ValueError(
                f"pageSize {self.page_size} must be a multiple of qsa.compressRatio {self.qsa.compress_ratio}"
            )
        return self

    # -- layer sets ---------------------------------------------------------------------------
    @property
    def full_attention_layer_ids(self) -> tuple[int, ...]:
        return self.full_attention_layers.resolve(self.num_layers)

    @property
    def swa_layer_ids(self) -> tuple[int, ...]:
        return self.swa.layers.resolve(self.num_layers) if self.swa else ()

    @property
    def linear_layer_ids(self) -> tuple[int, ...]:
        """Layers that are neither full attention nor SWA (empty without linear attention)."""
        if self.linear_attention is None:
            return ()
        taken = set(self.full_attention_layer_ids) | set(self.swa_layer_ids) | set(self.empty_layer_ids)
        return tuple(i for i in range(self.num_layers) if i not in taken)

    @property
    def empty_layer_ids(self) -> tuple[int, ...]:
        return self.empty_layers.resolve(self.num_layers) if self.empty_layers else ()

    @property
    def index_key_layer_ids(self) -> tuple[int, ...]:
        if self.index_keys is None:
            return ()
        if self.index_keys.layers is None:
            return self.full_attention_layer_ids
        return self.index_keys.layers.resolve(self.num_layers)

    @property
    def ple_layer_ids(self) -> tuple[int, ...]:
        return self.ple.short_conv_layers.resolve(self.num_layers) if self.ple else ()

    # -- what the capability matrix asks ----------------------------------------------------
    def state_types(self) -> frozenset[StateType]:
        """The state types a request of this layout carries."""
        out = {StateType.KV} if self.full_attention_layer_ids else set()
        if self.swa_layer_ids:
            out.add(StateType.SWA)
        if self.linear_layer_ids:
            out.add(StateType.MAMBA)
        if self.qsa is not None and self.full_attention_layer_ids:
            out |= {StateType.QSA_PENDING, StateType.QSA_COMPRESSED}
        if self.ple is not None:
            out.add(StateType.PLE_NGRAM)
            if self.ple_layer_ids:
                out.add(StateType.PLE_SHORT_CONV)
        if self.index_key_layer_ids:
            out.add(StateType.INDEX_K)
            if self.positions is not None:
                out.add(StateType.POSITIONS)
        return frozenset(out)

    @property
    def linear_heads(self) -> int | None:
        """The head count TP must divide for linear attention: gcd(key heads, value heads); None if absent."""
        la = self.linear_attention
        if la is None or not self.linear_layer_ids:
            return None
        if la.conv_groups is not None:  # the groups may be replicated; the temporal state is sliced by value head
            return la.num_value_heads
        return math.gcd(la.num_key_heads, la.num_value_heads)

    @property
    def qsa_compress_ratio(self) -> int | None:
        return self.qsa.compress_ratio if self.qsa is not None else None

    @property
    def kv_entry_dim(self) -> int:
        """Values per token per head of one KV entry: headDim (MHA) or kvLoraRank + qkRopeHeadDim (MLA)."""
        if self.mla is not None:
            return self.mla.kv_lora_rank + self.mla.qk_rope_head_dim
        assert self.head_dim is not None
        return self.head_dim

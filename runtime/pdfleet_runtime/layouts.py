"""A model's transferable state as data: layouts, presets, and the buffers each rank holds.

Pure (pydantic and the standard library only): the operator imports this module for its CRD
schema and for admission, so it must never import torch or an engine.

Reading order: the enums and the layout models (``layout_schema``: ``Layout`` and its parts, which become
the CRD's ``spec.layout.inline`` and whose descriptions are the ``kubectl explain`` text, re-exported here);
``LayoutRef`` and ``resolve_layout``; ``PRESETS``; then the per-rank derivation (``rank_buffers``,
``pool_counts``, ``rank_state_bytes``), which pools, the planner and the matrix share.

Conventions (design.md sections 1 and 2):

* PP stage ``k`` of ``pp`` holds a contiguous run of layers; the first ``num_layers % pp``
  stages hold one layer more (``stage_layers``).
* A KV page is head-major: ``[heads_per_rank, page_size, head_dim]``, so the slice of one head
  is contiguous and a heterogeneous-TP KV transfer is one block per page per layer entry.
* With ``H`` KV heads a TP rank holds ``max(1, H // tp)`` heads; when ``tp > H`` each head is
  replicated on ``tp // H`` ranks and rank ``s`` holds head ``s // (tp // H)``.
* Linear-attention conv state is ``[conv_kernel - 1, conv_channels_per_rank]`` with the
  channels grouped as q | k | v (each group sharded on its own); temporal state is
  ``[value_heads_per_rank, key_head_dim, value_head_dim]``.
* Request-wide states use sentinel layer ids (``ids.QSA_ROPE_LAYER_ID``,
  ``ids.PLE_NGRAM_LAYER_ID``). A stage holds the QSA RoPE ring iff it holds a QSA layer and the
  PLE n-gram history iff it holds a PLE short-conv layer.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from pydantic import Field, model_validator

from pdfleet_runtime.ids import INDEX_POSITIONS_LAYER_ID, PLE_NGRAM_LAYER_ID, QSA_ROPE_LAYER_ID, LayerId
from pdfleet_runtime.layout_schema import (  # the schema, re-exported
    AttentionKind,
    ConvGroup,
    DType,
    EntryField,
    IndexKeysConfig,
    IndexKind,
    LayerSet,
    Layout,
    LayoutError,
    LinearAttentionConfig,
    MLAConfig,
    PLEConfig,
    PositionsConfig,
    QSAConfig,
    ShapeError,
    Sharding,
    StateType,
    SWAConfig,
    UnknownPresetError,
    _Model,
)

__all__ = [
    "LAYOUT_DIGEST_LEN",
    "PRESETS",
    "AttentionKind",
    "BufferSpec",
    "ConvGroup",
    "DType",
    "EntryField",
    "IndexKeysConfig",
    "IndexKind",
    "LayerSet",
    "Layout",
    "LayoutError",
    "LayoutRef",
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
    "arena_offsets",
    "group_range",
    "item_bytes_by_kind",
    "layout_digest",
    "pages_for_tokens",
    "pool_counts",
    "rank_buffers",
    "rank_state_bytes",
    "replica_bytes",
    "replica_bytes_by_state",
    "resolve_layout",
    "stage_layers",
    "swa_pages_for_tokens",
]


class LayoutRef(_Model):
    """Either ``{preset: NAME}`` or ``{inline: {...Layout...}}``, never both."""

    preset: str | None = Field(default=None, description="Name of a built-in layout preset.")
    inline: Layout | None = Field(default=None, description="A layout given in full.")

    @model_validator(mode="after")
    def _exactly_one(self) -> LayoutRef:
        if (self.preset is None) == (self.inline is None):
            raise ValueError("exactly one of preset or inline must be set")
        return self


LAYOUT_DIGEST_LEN = 16


def layout_digest(layout: Layout) -> str:
    """A digest of the whole layout (dtypes, page size, every state): peers of two digests never pair (the
    handshakes of the pdfleet protocol and of the vLLM contract compare it)."""
    text = layout.model_dump_json(by_alias=True, exclude_none=True)
    return hashlib.sha256(text.encode()).hexdigest()[:LAYOUT_DIGEST_LEN]


def resolve_layout(ref: LayoutRef | Layout | str) -> Layout:
    """The layout a reference names; a string is a preset name. Raises ``UnknownPresetError``."""
    if isinstance(ref, Layout):
        return ref
    name = ref if isinstance(ref, str) else ref.preset
    if name is None:
        assert isinstance(ref, LayoutRef) and ref.inline is not None
        return ref.inline
    try:
        return PRESETS[name]
    except KeyError:
        raise UnknownPresetError(name, PRESETS) from None


# --------------------------------------------------------------------------- presets

_QWEN_NEXT_LINEAR = LinearAttentionConfig(
    num_key_heads=16, num_value_heads=32, key_head_dim=128, value_head_dim=128, conv_kernel=4
)
_QWEN_NEXT = {
    "num_layers": 48,
    "full_attention_layers": LayerSet(interval=4, offset=3),
    "kv_heads": 2,
    "head_dim": 256,
    "page_size": 64,
    "linear_attention": _QWEN_NEXT_LINEAR,
}

PRESETS: dict[str, Layout] = {
    # Qwen3-Next-80B-A3B's published config plus QSA on its 12 full-attention layers and PLE.
    "qwen3.8-flash-next": Layout(
        **_QWEN_NEXT,
        qsa=QSAConfig(compress_ratio=4, index_heads=4, index_head_dim=128),
        ple=PLEConfig(
            short_conv_layers=LayerSet(interval=1),
            short_conv_width=256,
            short_conv_kernel=4,
            ngram_context=8,
        ),
    ),
    "qwen3-next-hybrid": Layout(**_QWEN_NEXT),
    # Llama-3-8B.
    "llama-dense": Layout(
        num_layers=32, full_attention_layers=LayerSet(interval=1), kv_heads=8, head_dim=128, page_size=16
    ),
    # DeepSeek-V3.
    "deepseek-mla": Layout(
        num_layers=61,
        full_attention_layers=LayerSet(interval=1),
        attention_kind=AttentionKind.MLA,
        kv_heads=1,
        mla=MLAConfig(kv_lora_rank=512, qk_rope_head_dim=64),
        page_size=64,
    ),
}


# --------------------------------------------------------------------------- per-rank buffers


@dataclass(frozen=True)
class BufferSpec:
    """One buffer of one rank: the metadata a registration record carries (without the address).

    An item (one page, slot or row) is ``outer_count`` rows of ``dim`` units of ``unit_bytes``
    along the sliceable dim; replicated buffers have ``dim == 0`` and ``outer_count == 1``.
    ``shard_groups`` are the global (unsharded) widths, in units, of groups sharded on their own.
    ``total_heads`` is the model's KV head count for ``Sharding.HEADS``. ``group_heads`` gives each shard
    group's heads when groups were declared (replicated when fewer than TP).
    """

    state_type: StateType
    field: EntryField
    layer_id: LayerId
    index: IndexKind
    item_shape: tuple[int, ...]
    dtype: DType
    sharding: Sharding
    dim: int
    outer_count: int
    unit_bytes: int
    shard_groups: tuple[int, ...] | None = None
    total_heads: int = 0
    group_heads: tuple[int, ...] | None = None
    """Heads of each shard group, when the groups were declared (``conv_groups``): a group whose heads do
    not divide by TP is replicated, one head per rank (the planner elects one writer)."""

    @property
    def item_bytes(self) -> int:
        return math.prod(self.item_shape) * self.dtype.itemsize

    @property
    def key(self) -> tuple[StateType, EntryField]:
        """The pairing group."""
        return (self.state_type, self.field)

    def describe(self) -> str:
        return f"{self.state_type.value}/{self.field.value} layer {self.layer_id}"


def group_range(width: int, heads: int, tp: int, rank: int) -> tuple[int, int]:
    """``(first channel, channels)`` of a channel group of ``heads`` x ``width / heads`` that rank ``rank`` of
    ``tp`` holds: its ``1/tp`` share when tp divides the heads, else the one head ``rank // (tp / heads)``
    (replicated on ``tp / heads`` ranks). ValueError when neither divides the other."""
    if heads < 1 or width % heads or (heads % tp and tp % heads):
        raise ValueError(f"a group of {width} channels in {heads} heads cannot be split by tp={tp}")
    if heads % tp == 0:
        n = width // tp
        return rank * n, n
    n = width // heads
    return (rank // (tp // heads)) * n, n


def _check_shape(tp: int, pp: int, tp_rank: int, pp_rank: int, num_layers: int) -> None:
    if tp < 1 or pp < 1:
        raise ShapeError(f"tp={tp} and pp={pp} must be at least 1", "tp" if tp < 1 else "pp")
    if not (0 <= tp_rank < tp and 0 <= pp_rank < pp):
        raise ShapeError(f"rank (tp {tp_rank}, pp {pp_rank}) is outside shape tp={tp}, pp={pp}", "rank")
    if pp > num_layers:
        raise ShapeError(f"pp={pp} exceeds numLayers {num_layers}", "pp")


def stage_layers(num_layers: int, pp: int, pp_rank: int) -> range:
    """Layers of PP stage ``pp_rank``: contiguous, the first ``num_layers % pp`` stages one longer."""
    base, extra = divmod(num_layers, pp)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (1 if pp_rank < extra else 0))


def _heads_spec(
    state: StateType, field: EntryField, layer: int, index: IndexKind, layout: Layout, tp: int
) -> BufferSpec:
    h = layout.kv_heads
    if h % tp and tp % h:
        raise ShapeError(f"tp={tp} and kvHeads {h} must divide one another", "kvHeads")
    hpr = max(1, h // tp)
    d = layout.kv_entry_dim
    return BufferSpec(
        state, field, LayerId(layer), index, (hpr, layout.page_size, d), layout.dtype, Sharding.HEADS,
        dim=hpr, outer_count=1, unit_bytes=layout.page_size * d * layout.dtype.itemsize, total_heads=h,
    )


def _replicated(
    state: StateType, field: EntryField, layer: int, index: IndexKind, shape: tuple[int, ...], dtype: DType
) -> BufferSpec:
    return BufferSpec(state, field, LayerId(layer), index, shape, dtype, Sharding.REPLICATED, 0, 1, 0)


def rank_buffers(layout: Layout, tp: int, pp: int, tp_rank: int, pp_rank: int) -> tuple[BufferSpec, ...]:
    """Every buffer rank (tp_rank, pp_rank) of a (tp, pp) shape holds, ordered by layer then field.

    Raises ``ShapeError`` when the shape cannot split the layout (heads not divisible, pp too deep).
    """
    _check_shape(tp, pp, tp_rank, pp_rank, layout.num_layers)
    layers = stage_layers(layout.num_layers, pp, pp_rank)
    full, swa = set(layout.full_attention_layer_ids), set(layout.swa_layer_ids)
    linear, ple = set(layout.linear_layer_ids), set(layout.ple_layer_ids)
    la, qsa = layout.linear_attention, layout.qsa
    index_layers = set(layout.index_key_layer_ids)
    out: list[BufferSpec] = []
    if la is not None and linear:
        checks = [("numValueHeads", la.num_value_heads)]
        if la.conv_groups is None:
            checks.insert(0, ("numKeyHeads", la.num_key_heads))
        for name, heads in checks:
            if heads % tp:
                raise ShapeError(f"linearAttention.{name} {heads} is not divisible by tp={tp}", name)
        for i, g in enumerate(la.conv_groups or ()):
            if g.heads % tp and tp % g.heads:
                raise ShapeError(f"linearAttention.convGroups[{i}].heads {g.heads} and tp={tp} must divide one "
                                 "another", "convGroups")
    for layer in layers:
        if layer in full:
            if layout.attention_kind is AttentionKind.MLA:
                out.append(_replicated(StateType.KV, EntryField.LATENT, layer, IndexKind.PAGE,
                                       (layout.page_size, layout.kv_entry_dim), layout.dtype))
            else:
                for f in (EntryField.K, EntryField.V):
                    out.append(_heads_spec(StateType.KV, f, layer, IndexKind.PAGE, layout, tp))
            if qsa is not None:
                ih = (qsa.index_heads, qsa.index_head_dim)
                out.append(_replicated(StateType.QSA_PENDING, EntryField.PENDING, layer, IndexKind.ROW,
                                       (qsa.compress_ratio, *ih), qsa.dtype))
                out.append(_replicated(StateType.QSA_COMPRESSED, EntryField.COMPRESSED, layer, IndexKind.PAGE,
                                       (layout.page_size // qsa.compress_ratio, *ih), qsa.dtype))
        if layer in swa:
            for f in (EntryField.K, EntryField.V):
                out.append(_heads_spec(StateType.SWA, f, layer, IndexKind.SWA_PAGE, layout, tp))
        if layer in linear:
            assert la is not None
            groups = la.conv_shard_groups
            conv_dim = sum(g.per_rank(tp) for g in la.groups)
            out.append(BufferSpec(
                StateType.MAMBA, EntryField.CONV, LayerId(layer), IndexKind.SLOT,
                (la.conv_kernel - 1, conv_dim), la.conv_dtype, Sharding.DIM,
                dim=conv_dim, outer_count=la.conv_kernel - 1, unit_bytes=la.conv_dtype.itemsize,
                shard_groups=groups,
                group_heads=tuple(g.heads for g in la.groups) if la.conv_groups is not None else None,
            ))
            vh = la.num_value_heads // tp
            out.append(BufferSpec(
                StateType.MAMBA, EntryField.TEMPORAL, LayerId(layer), IndexKind.SLOT,
                (vh, la.key_head_dim, la.value_head_dim), la.temporal_dtype, Sharding.DIM,
                dim=vh, outer_count=1, unit_bytes=la.key_head_dim * la.value_head_dim * la.temporal_dtype.itemsize,
            ))
        if layer in index_layers:
            ik = layout.index_keys
            assert ik is not None
            shape, dtype = ik.token_shape
            out.append(_replicated(StateType.INDEX_K, EntryField.INDEX_K, layer, IndexKind.PAGE,
                                   (layout.page_size, *shape), dtype))
        if layer in ple:
            assert layout.ple is not None
            out.append(_replicated(StateType.PLE_SHORT_CONV, EntryField.SHORT_CONV, layer, IndexKind.SLOT,
                                   (layout.ple.short_conv_columns, layout.ple.short_conv_width),
                                   layout.ple.dtype))
            if layout.ple.ngram_per_layer:
                out.append(_replicated(StateType.PLE_NGRAM, EntryField.NGRAM, layer, IndexKind.SLOT,
                                       (layout.ple.ngram_context,), layout.ple.ngram_dtype))
    if qsa is not None and full.intersection(layers):
        rope_shape = (qsa.compress_ratio,) if qsa.rope_positions == 1 else (qsa.compress_ratio, qsa.rope_positions)
        out.append(_replicated(StateType.QSA_PENDING, EntryField.ROPE, QSA_ROPE_LAYER_ID, IndexKind.ROW,
                               rope_shape, qsa.rope_dtype))
    if layout.positions is not None and index_layers.intersection(layers):
        pos = layout.positions
        out.append(_replicated(StateType.POSITIONS, EntryField.POSITIONS, INDEX_POSITIONS_LAYER_ID, IndexKind.PAGE,
                               (layout.page_size, pos.coordinates), pos.dtype))
    if layout.ple is not None and not layout.ple.ngram_per_layer and (
            ple.intersection(layers) or (not ple and pp_rank == 0)):
        out.append(_replicated(StateType.PLE_NGRAM, EntryField.NGRAM, PLE_NGRAM_LAYER_ID, IndexKind.SLOT,
                               (layout.ple.ngram_context,), layout.ple.ngram_dtype))
    return tuple(out)


def pages_for_tokens(tokens: int, page_size: int) -> int:
    """KV pages a request of ``tokens`` tokens occupies."""
    return -(-tokens // page_size)


def swa_pages_for_tokens(tokens: int, window: int, page_size: int) -> int:
    """SWA pages covering the last ``min(tokens, window)`` tokens (pages aligned at 0)."""
    if tokens <= 0:
        return 0
    first = max(0, tokens - window) // page_size
    return (tokens - 1) // page_size - first + 1


def pool_counts(layout: Layout, max_requests: int, max_tokens: int) -> dict[IndexKind, int]:
    """Items per index kind for a capacity of ``max_requests`` requests and ``max_tokens`` tokens in all.

    Pages: ``ceil(max_tokens / page_size) + max_requests`` (each request may leave its last page
    part full). SWA pages: ``max_requests * (ceil(window / page_size) + 1)``, capped at the page count.
    """
    if max_requests < 1 or max_tokens < 1:
        raise ValueError(f"capacity needs max_requests >= 1 and max_tokens >= 1, got {max_requests}, {max_tokens}")
    pages = pages_for_tokens(max_tokens, layout.page_size) + max_requests
    swa_pages = 0
    if layout.swa is not None:
        swa_pages = min(pages, max_requests * (pages_for_tokens(layout.swa.window, layout.page_size) + 1))
    return {IndexKind.PAGE: pages, IndexKind.SWA_PAGE: swa_pages,
            IndexKind.SLOT: max_requests, IndexKind.ROW: max_requests}


def arena_offsets(sizes: Iterable[int], align: int = 1) -> tuple[list[int], int]:
    """Where buffers of these byte sizes start when laid back to back, each start ``align``-aligned, and
    the arena's size: the one place arena bytes are added up (``pools.RankPools`` aligns to 256 bytes,
    ``records.virtual_registration`` and ``rank_state_bytes`` do not align)."""
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // align) * align
    return offsets, total


def item_bytes_by_kind(layout: Layout, tp: int, pp: int, pp_rank: int) -> dict[IndexKind, int]:
    """Bytes of one item of each index kind over all buffers of a rank of stage ``pp_rank`` (all TP ranks
    equal): a rank's pool bytes are these times the capacity's ``pool_counts``."""
    per_kind: dict[IndexKind, int] = {}
    for buf in rank_buffers(layout, tp, pp, 0, pp_rank):
        per_kind[buf.index] = per_kind.get(buf.index, 0) + buf.item_bytes
    return per_kind


def replica_bytes(layout: Layout, tp: int, pp: int, counts: Mapping[IndexKind, int]) -> int:
    """Bytes of ``counts`` items of each index kind over every rank of a tp x pp replica (a request's
    state on a whole pod, or a pod's pools)."""
    return sum(tp * counts[k] * b for stage in range(pp) for k, b in item_bytes_by_kind(layout, tp, pp, stage).items())


def replica_bytes_by_state(layout: Layout, tp: int, pp: int, counts: Mapping[IndexKind, int]) -> dict[StateType, int]:
    """``replica_bytes`` split by state type (KV, Mamba, sliding window, ...): what each kind of state of a request
    weighs over a whole pod. The parts sum to ``replica_bytes``."""
    out: dict[StateType, int] = {}
    for stage in range(pp):
        for buf in rank_buffers(layout, tp, pp, 0, stage):
            out[buf.state_type] = out.get(buf.state_type, 0) + tp * counts[buf.index] * buf.item_bytes
    return out


def rank_state_bytes(layout: Layout, tp: int, pp: int, pp_rank: int, max_requests: int, max_tokens: int) -> int:
    """GPU bytes one rank of stage ``pp_rank`` needs for its pools at this capacity (all TP ranks equal).

    Admission compares this with the memory of one device ("pools must fit the GPU").
    """
    counts = pool_counts(layout, max_requests, max_tokens)
    return sum(b * counts[k] for k, b in item_bytes_by_kind(layout, tp, pp, pp_rank).items())

"""The one mapping between a model's cache and pdfleet's pools, used by both sides of a transfer.

Three forms of one request's state:

* the model's cache: transformers' ``DynamicCache`` (batch 1), as the model fills and reads it;
* ``ModelState``: the same state unsharded, per global layer id, in the pools' orientation;
* each rank's share: the request's items of that rank's buffers (``layouts.rank_buffers``), as its pools
  hold them, or as raw bytes (``model.state.RankShare``) once read out.

``state_from_cache`` and ``cache_from_state`` convert the first two; ``write_share`` writes a rank's share of
a ``ModelState`` into its pools at the request's pages and slot (a prefill rank, after its forward);
``read_share`` reads a rank's items back as bytes and ``gather_state`` rebuilds the ``ModelState`` from every
rank's share (a decode). Sharding follows the layout's conventions (layouts.py, design.md section 2):

* KV (MHA): ``[heads, tokens, head_dim]`` -> head-major pages ``[heads_per_rank, page_size, head_dim]``, rank
  ``s`` holding heads ``[first, first + max(1, H // tp))`` with ``first = (s // max(1, tp // H)) * max(1, H // tp)``
  (a head replicated on ``tp // H`` ranks when tp exceeds the KV heads);
* MLA: latent ``[tokens, kv_lora_rank]`` and rope key ``[tokens, qk_rope_head_dim]`` concatenated per token, on
  every rank;
* GDN conv: transformers keeps ``[channels, K]`` but never reads the oldest column, so the newest ``K - 1`` are
  kept, transposed to ``[K - 1, channels]``; the channels are q | k | v, each group sharded on its own;
* GDN recurrent: ``[value_heads, key_dim, value_dim]``, sliced by value head;
* PP: a stage's pools hold only its layers, so it writes only those; a gather needs every stage's shares.

Pages follow token positions; the last page is zero-padded, and the length is request metadata (a decode
knows its prompt). Gathering checks that replicated state (MLA latent, KV heads replicated across ranks)
is equal on every rank that holds it: a decode computing on each rank's copy would otherwise diverge.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from pdfleet_runtime.ids import INDEX_POSITIONS_LAYER_ID
from pdfleet_runtime.layouts import (
    AttentionKind,
    BufferSpec,
    EntryField,
    Layout,
    Sharding,
    StateType,
    group_range,
    rank_buffers,
)
from pdfleet_runtime.model.state import RankShare
from pdfleet_runtime.pools import RankPools, torch_dtype
from pdfleet_runtime.records import ParallelShape, RequestIndices

__all__ = [
    "ModelState",
    "ShareError",
    "cache_from_state",
    "gather_state",
    "read_share",
    "state_from_cache",
    "write_share",
]


class ShareError(ValueError):
    """A share that cannot be (or was not) what the layout says: wrong shapes, dtypes, or replicas that differ."""


@dataclass
class ModelState:
    """One request's state, unsharded, per global layer id (batch dimension dropped).

    ``kv[layer]``: MHA ``(K, V)`` each ``[kv_heads, length, head_dim]``; MLA ``(latent, rope)``
    ``[length, kv_lora_rank]`` and ``[length, qk_rope_head_dim]``. ``conv[layer]``: ``[K - 1, channels]``;
    ``recurrent[layer]``: ``[value_heads, key_dim, value_dim]``.
    """

    length: int
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    conv: dict[int, torch.Tensor] = field(default_factory=dict)
    recurrent: dict[int, torch.Tensor] = field(default_factory=dict)
    extra: dict[tuple[StateType, int], torch.Tensor] = field(default_factory=dict)
    """Qwen4-Exp's other states by (state type, layer id): index keys ``[length, heads, dim]``, positions
    ``[length, 3]`` (layer ``ids.INDEX_POSITIONS_LAYER_ID``), PLE conv ``[(K-1) x dilation, channels]``, n-gram
    ids ``[ngram_size - 1]``."""

    def equal(self, other: ModelState) -> bool:
        """Bit-for-bit the same state (tests, and the harness's cross-check)."""
        def same(a: Mapping[int, object], b: Mapping[int, object]) -> bool:
            return a.keys() == b.keys() and all(_eq(a[k], b[k]) for k in a)

        return (self.length == other.length and same(self.kv, other.kv) and same(self.conv, other.conv)
                and same(self.recurrent, other.recurrent) and same(self.extra, other.extra))  # type: ignore[arg-type]


def _eq(a: object, b: object) -> bool:
    if isinstance(a, tuple):
        return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))  # type: ignore[arg-type]
    return torch.equal(a, b)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- cache <-> ModelState


def state_from_cache(cache: object, layout: Layout, length: int, *, conv_lag: int = 0) -> ModelState:
    """The unsharded state a model's cache holds after ``length`` tokens (batch 1).

    ``conv_lag`` (fault injection only, ``ModelFault.CONV_SHIFTED``): take the conv window that many tokens
    older than the newest ``K - 1`` columns.
    """
    layers = cache.layers  # type: ignore[attr-defined]
    if len(layers) != layout.num_layers:
        raise ShareError(f"the cache has {len(layers)} layers, the layout {layout.num_layers}")
    out = ModelState(length)
    window = layout.swa.window if layout.swa is not None else None
    swa = set(layout.swa_layer_ids)
    for i in (*layout.full_attention_layer_ids, *layout.swa_layer_ids):
        keys, values = layers[i].keys, layers[i].values
        want = min(length, window) if i in swa and window is not None else length  # a window keeps its last tokens
        if keys is None or keys.shape[-2] != want:
            raise ShareError(f"layer {i}: the cache holds {None if keys is None else keys.shape[-2]} tokens, "
                             f"expected {want}")
        if layout.attention_kind is AttentionKind.MLA:
            out.kv[i] = (keys[0, 0].clone(), values[0, 0].clone())
        else:
            out.kv[i] = (keys[0].clone(), values[0].clone())
    for i in layout.linear_layer_ids:
        conv, rec = layers[i].conv_states[0], layers[i].recurrent_states[0]
        k = conv.shape[-1]
        window = conv[0, :, 1 - conv_lag : k - conv_lag]  # the newest K-1 columns (unless lagged)
        out.conv[i] = window.transpose(0, 1).contiguous()  # [K-1, channels]
        out.recurrent[i] = rec[0].clone()
    for i in layout.index_key_layer_ids:  # [1, S, dim] -> [S, heads, dim]
        keys = layers[i].indexer_keys
        out.extra[(StateType.INDEX_K, i)] = keys[0].reshape(length, -1, keys.shape[-1]).clone()
        pos = getattr(layers[i], "indexer_position_ids", None)
        if layout.positions is not None and pos is not None and (StateType.POSITIONS, INDEX_POSITIONS_LAYER_ID) \
                not in out.extra:  # [3, 1, S] -> [S, 3]: request-wide, on the first indexed layer
            out.extra[(StateType.POSITIONS, INDEX_POSITIONS_LAYER_ID)] = pos[:, 0].transpose(0, 1).contiguous()
    for i in layout.ple_layer_ids:  # PLE conv [1, C, cols] -> [cols, C]; n-grams [1, n]
        out.extra[(StateType.PLE_SHORT_CONV, i)] = layers[i].conv_states[1][0].transpose(0, 1).contiguous()
        out.extra[(StateType.PLE_NGRAM, i)] = layers[i].conv_states[2][0].clone()
    return out


def cache_from_state(state: ModelState, config: object, layout: Layout) -> object:
    """A transformers ``DynamicCache`` for ``config`` holding ``state``, from which the model continues."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    if len(cache.layers) != layout.num_layers:
        raise ShareError(f"the model's cache has {len(cache.layers)} layers, the layout {layout.num_layers}")
    for i, (a, b) in sorted(state.kv.items()):
        if layout.attention_kind is AttentionKind.MLA:
            cache.layers[i].update(a[None, None], b[None, None])
        else:
            cache.layers[i].update(a[None], b[None])
        if i in layout.swa_layer_ids:  # the window holds the last tokens; the position is the request's length
            cache.layers[i].cumulative_length = state.length
    for i, conv in sorted(state.conv.items()):
        la = layout.linear_attention
        assert la is not None
        full = torch.cat([conv.new_zeros(1, conv.shape[1]), conv], 0).transpose(0, 1)  # the unread oldest column
        cache.layers[i].update_conv_state(full[None].contiguous(), conv_kernel_size=la.conv_kernel)
        cache.layers[i].update_recurrent_state(state.recurrent[i][None].clone())
    for (st, i), t in sorted(state.extra.items(), key=lambda kv: (kv[0][0].value, kv[0][1])):
        if st is StateType.INDEX_K:
            cache.layers[i].update_indexer(t.reshape(1, t.shape[0], -1).clone())
        elif st is StateType.POSITIONS:
            first = layout.index_key_layer_ids[0]
            cache.layers[first].indexer_position_ids = t.transpose(0, 1)[:, None].contiguous()
        elif st is StateType.PLE_SHORT_CONV:
            cache.layers[i].update_conv_state(t.transpose(0, 1)[None].contiguous(), state_idx=1,
                                              conv_kernel_size=t.shape[0])
        elif st is StateType.PLE_NGRAM:
            cache.layers[i].update_conv_state(t[None].clone(), state_idx=2, conv_kernel_size=t.shape[0])
    return cache


# --------------------------------------------------------------------------- sharding


def _first_head(rank: int, tp: int, heads: int) -> int:
    return (rank // max(1, tp // heads)) * max(1, heads // tp)


def _group_slices(spec: BufferSpec, tp: int, rank: int) -> list[tuple[int, int]]:
    """(start, width) in the global channel dim of each shard group's slice held by ``rank``."""
    groups = spec.shard_groups or (spec.dim * tp,)
    heads = spec.group_heads or tuple(tp for _ in groups)  # undeclared groups (q|k|v): sharded by TP
    out, start = [], 0
    for g, h in zip(groups, heads, strict=True):
        first, w = group_range(g, h, tp, rank)  # declared groups with fewer heads than TP: replicated
        out.append((start + first, w))
        start += g
    return out


def _logical(state: ModelState, spec: BufferSpec, layout: Layout) -> torch.Tensor:
    """The unsharded tensor one buffer holds a slice of (KV: padded per page later)."""
    layer = int(spec.layer_id)
    if spec.state_type in (StateType.KV, StateType.SWA):
        if spec.field is EntryField.LATENT:
            lat, rope = state.kv[layer]
            return torch.cat([lat, rope], -1)
        k, v = state.kv[layer]
        return k if spec.field is EntryField.K else v
    if spec.field is EntryField.CONV:
        return state.conv[layer]
    if spec.field is EntryField.TEMPORAL:
        return state.recurrent[layer]
    if (spec.state_type, layer) in state.extra:
        return state.extra[(spec.state_type, layer)]
    raise ShareError(f"{spec.describe()}: the reference engine keeps no such state")


def _swa_offset(layout: Layout, length: int, kept: int) -> int:
    """Row of a window's first kept token within the request's first SWA page (pages follow positions)."""
    assert layout.swa is not None
    return (length - kept) - (max(0, length - layout.swa.window) // layout.page_size) * layout.page_size


def _shard(full: torch.Tensor, spec: BufferSpec, layout: Layout, tp: int, rank: int, pages: int,
           length: int = 0) -> torch.Tensor:
    """This rank's items of one buffer: ``[items, *item_shape]``."""
    ps = layout.page_size
    if spec.sharding is Sharding.HEADS:  # full [H, S, D] -> [pages, hpr, ps, D]
        h, s, d = full.shape
        hpr = spec.item_shape[0]
        first = _first_head(rank, tp, h)
        at = _swa_offset(layout, length, s) if spec.state_type is StateType.SWA else 0
        heads = torch.zeros(hpr, pages * ps, d, dtype=full.dtype, device=full.device)
        heads[:, at : at + s] = full[first : first + hpr]
        return heads.view(hpr, pages, ps, d).transpose(0, 1)
    if spec.state_type is StateType.KV or spec.state_type in _PAGED_EXTRA:  # replicated per-token state:
        s = full.shape[0]  # [S, *rest] -> [pages, ps, *rest] (MLA latent, index keys, positions)
        out = torch.zeros(pages * ps, *full.shape[1:], dtype=full.dtype, device=full.device)
        out[:s] = full
        return out.view(pages, ps, *full.shape[1:])
    if spec.state_type in _SLOT_EXTRA:  # replicated per-request state: [1, *item]
        return full[None]
    if spec.field is EntryField.CONV:  # [K-1, C] -> [1, K-1, C/tp], q | k | v each sliced
        parts = [full[:, a : a + w] for a, w in _group_slices(spec, tp, rank)]
        return torch.cat(parts, 1)[None]
    if spec.field is EntryField.TEMPORAL:  # [Hv, Dk, Dv] -> [1, Hv/tp, Dk, Dv]
        n = spec.item_shape[0]
        return full[rank * n : (rank + 1) * n][None]
    raise ShareError(f"{spec.describe()}: no sharding rule")


_PAGED_EXTRA = frozenset({StateType.INDEX_K, StateType.POSITIONS})
_SLOT_EXTRA = frozenset({StateType.PLE_SHORT_CONV, StateType.PLE_NGRAM})


def write_share(pools: RankPools, state: ModelState, idx: RequestIndices) -> int:
    """Write this rank's share of ``state`` into its pools at the request's items; the bytes written.

    Every buffer the rank holds must be one the model keeps (KV, MLA latent, GDN conv and recurrent), in
    the dtype the model keeps it in (no silent casts: a mismatch raises ``ShareError``).
    """
    written = 0
    tp = pools.shape.tp
    for i, rec in enumerate(pools.records):
        spec = rec.spec
        items = idx.of(spec.index)
        full = _logical(state, spec, pools.layout)
        if full.dtype != torch_dtype(spec.dtype):
            raise ShareError(f"{spec.describe()}: the model keeps {full.dtype}, the pool holds {spec.dtype.value}; "
                             "the layout's dtype must be the model's (config.json dtype)")
        data = _shard(full, spec, pools.layout, tp, pools.tp_rank, int(items.size), state.length)
        if tuple(data.shape) != (items.size, *spec.item_shape):
            raise ShareError(f"{spec.describe()}: share {tuple(data.shape)} does not fit items "
                             f"{(int(items.size), *spec.item_shape)}")
        view = pools.tensor(i)
        view.index_copy_(0, torch.from_numpy(np.array(items, dtype=np.int64)).to(view.device),
                         data.to(view.device).contiguous())
        written += data.numel() * data.element_size()
    return written


def read_share(pools: RankPools, idx: RequestIndices) -> RankShare:
    """This rank's items of a request, as raw bytes read from its own pools (a host copy)."""
    out = []
    for i, rec in enumerate(pools.records):
        items = torch.from_numpy(np.array(idx.of(rec.spec.index), dtype=np.int64))
        view = pools.byte_view(i)
        out.append(view.index_select(0, items.to(view.device)).cpu().numpy().tobytes())
    return RankShare(pools.tp_rank, pools.pp_rank, tuple(out))


def _typed(raw: bytes, spec: BufferSpec, device: torch.device | str) -> torch.Tensor:
    if not raw or len(raw) % spec.item_bytes:
        raise ShareError(f"{spec.describe()}: a share of {len(raw)} bytes is not whole items of {spec.item_bytes}")
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)
    return t.view(torch_dtype(spec.dtype)).view(len(raw) // spec.item_bytes, *spec.item_shape)


class _Slots:
    """Fills one unsharded tensor from its slices, checking that every part is written and replicas agree."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.full: torch.Tensor | None = None
        self.seen: torch.Tensor | None = None
        self.owner: dict[int, tuple[int, int]] = {}

    def put(self, shape: Sequence[int], like: torch.Tensor, where: tuple[slice, ...], part: torch.Tensor,
            rank: tuple[int, int], key: int) -> None:
        if self.full is None:
            self.full = torch.zeros(*shape, dtype=like.dtype, device=like.device)
            self.seen = torch.zeros(*shape, dtype=torch.bool, device=like.device)
        assert self.seen is not None
        if bool(self.seen[where].all()):
            if not torch.equal(self.full[where], part):
                raise ShareError(f"{self.name}: ranks {self.owner.get(key)} and {rank} (tp, pp) hold different "
                                 "copies of replicated state")
            return
        self.full[where] = part
        self.seen[where] = True
        self.owner.setdefault(key, rank)

    def done(self) -> torch.Tensor:
        if self.full is None or self.seen is None or not bool(self.seen.all()):
            raise ShareError(f"{self.name}: no rank's share covers all of it")
        return self.full


def gather_state(layout: Layout, shape: ParallelShape, shares: Iterable[RankShare], length: int,
                 device: torch.device | str = "cpu") -> ModelState:
    """The unsharded state of a request from every rank's share (``shape``'s ranks, all of them).

    ``length`` is the request's token count (the pages' padding is dropped). Raises ``ShareError`` when a rank
    is missing, a share does not fit the layout, or replicas differ.
    """
    got = {(s.tp_rank, s.pp_rank): s for s in shares}
    missing = sorted(set(shape.coords()) - set(got))
    if missing:
        raise ShareError(f"shares of ranks (tp, pp) {missing} are missing; a gather needs every rank of {shape}")
    tp = shape.tp
    slots: dict[tuple[StateType, EntryField, int], _Slots] = {}
    for (t, p), share in sorted(got.items()):
        specs = rank_buffers(layout, shape.tp, shape.pp, t, p)
        if len(specs) != len(share.buffers):
            raise ShareError(f"rank (tp {t}, pp {p}) sent {len(share.buffers)} buffers, its layout has {len(specs)}")
        for spec, raw in zip(specs, share.buffers, strict=True):
            part = _typed(raw, spec, device)
            key = (spec.state_type, spec.field, int(spec.layer_id))
            slot = slots.setdefault(key, _Slots(spec.describe()))
            if spec.sharding is Sharding.HEADS:
                hpr, d = spec.item_shape[0], spec.item_shape[2]
                kept, at = length, 0
                if spec.state_type is StateType.SWA:
                    assert layout.swa is not None
                    kept = min(length, layout.swa.window)
                    at = _swa_offset(layout, length, kept)
                heads = part.transpose(0, 1).reshape(hpr, -1, d)[:, at : at + kept]
                first = _first_head(t, tp, spec.total_heads)
                slot.put((spec.total_heads, kept, d), heads, (slice(first, first + hpr),), heads, (t, p), first)
            elif spec.state_type is StateType.KV or spec.state_type in _PAGED_EXTRA:
                lat = part.reshape(-1, *spec.item_shape[1:])[:length]
                if spec.state_type is StateType.KV:
                    lat = lat.reshape(length, -1)
                slot.put(tuple(lat.shape), lat, (slice(None),), lat, (t, p), 0)
            elif spec.state_type in _SLOT_EXTRA:
                slot.put(tuple(part[0].shape), part[0], (slice(None),), part[0], (t, p), 0)
            elif spec.field is EntryField.CONV:
                conv = part[0]
                width = sum(spec.shard_groups or (spec.dim * tp,))
                at = 0
                for a, w in _group_slices(spec, tp, t):
                    slot.put((conv.shape[0], width), conv, (slice(None), slice(a, a + w)), conv[:, at : at + w],
                             (t, p), a)
                    at += w
            elif spec.field is EntryField.TEMPORAL:
                rec = part[0]
                n = rec.shape[0]
                slot.put((n * tp, *rec.shape[1:]), rec, (slice(t * n, (t + 1) * n),), rec, (t, p), t)
            else:
                raise ShareError(f"{spec.describe()}: the reference engine keeps no such state")
    out = ModelState(length)
    for (st, fld, layer), slot in sorted(slots.items()):
        full = slot.done()
        if st is StateType.KV and fld is EntryField.LATENT:
            assert layout.mla is not None
            r = layout.mla.kv_lora_rank
            out.kv[layer] = (full[:, :r].contiguous(), full[:, r:].contiguous())
        elif st in (StateType.KV, StateType.SWA):
            k, v = out.kv.get(layer, (None, None))
            out.kv[layer] = (full, v) if fld is EntryField.K else (k, full)  # type: ignore[assignment]
        elif fld is EntryField.CONV:
            out.conv[layer] = full
        elif fld is EntryField.TEMPORAL:
            out.recurrent[layer] = full
        else:
            out.extra[(st, layer)] = full
    return out

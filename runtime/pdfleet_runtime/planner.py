"""Pure, vectorized transfer planning: which bytes of which prefill rank go where on decode.

Algorithm (design.md section 2), in the order the code applies it:

1. Ranks. ``source_ranks`` lists the prefill ranks a decode rank pairs with: the TP-mapped
   rank(s) (one on scatter P <= D, P/D on aggregation P > D) in its own stage, or in every
   stage when decode PP is 1.
2. Pairing (``compile_pair``, once per pair of registrations). Buffers are grouped by
   (state type, field) and paired inside a group by global layer id (``pair_entries``).
   Sentinel (request-wide) buffers are sent only by the lowest source stage that holds them
   among those a decode rank pairs with (``elect_sentinel_stages``).
3. Slicing. Each paired buffer gets its in-item blocks: ``slice_blocks`` for sliceable dims and
   replicated state (writer election, ``should_send_replicated``), ``head_blocks`` for KV heads
   (replicated when TP > heads, electing one replica per head).
4. Per request (``PairPlan.plan``): the exact-length and range checks on the index arrays,
   then addresses for all buffers at once with numpy broadcasting. Whole-item blocks of items
   consecutive on both sides merge into one block (coalescing); partial blocks stay one per
   item, so a heterogeneous-TP KV transfer is one block per page per layer entry.

Errors are ``PlanError``s naming the state type, the layer and the indices.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from pdfleet_runtime.ids import is_sentinel
from pdfleet_runtime.layouts import EntryField, IndexKind, Sharding, StateType, group_range
from pdfleet_runtime.records import BufferRecord, ParallelShape, RankRegistration, RequestIndices

__all__ = [
    "STATE_ORDER",
    "Blocks",
    "DestinationPlan",
    "PairPlan",
    "PlanError",
    "check_shapes",
    "coalesce",
    "compile_destination",
    "compile_pair",
    "elect_sentinel_stages",
    "group_range",
    "head_blocks",
    "pair_entries",
    "should_send_head",
    "should_send_replicated",
    "slice_blocks",
    "source_ranks",
]

STATE_ORDER: tuple[StateType, ...] = tuple(StateType)
"""``Blocks.state`` holds positions in this tuple."""
_STATE_CODE = {s: i for i, s in enumerate(STATE_ORDER)}


class PlanError(ValueError):
    """A transfer that cannot be planned; names the state type, layer and indices when known."""

    def __init__(
        self,
        message: str,
        *,
        state_type: StateType | None = None,
        layer_id: int | None = None,
        indices: Iterable[int] = (),
        rule: str | None = None,
    ) -> None:
        self.state_type = state_type
        self.layer_id = layer_id
        self.indices = tuple(int(i) for i in indices)
        self.rule = rule
        where = []
        if state_type is not None:
            where.append(f"state {state_type.value}")
        if layer_id is not None:
            where.append(f"layer {layer_id}")
        if self.indices:
            where.append(f"indices {list(self.indices)}")
        super().__init__(f"{message} ({', '.join(where)})" if where else message)


# --------------------------------------------------------------------------- TP arithmetic


def _check_tp(src_tp: int, dst_tp: int) -> None:
    if src_tp < 1 or dst_tp < 1:
        raise ValueError(f"TP sizes must be at least 1, got src_tp={src_tp}, dst_tp={dst_tp}")
    if max(src_tp, dst_tp) % min(src_tp, dst_tp):
        raise ValueError(f"TP sizes must divide one another, got src_tp={src_tp}, dst_tp={dst_tp}")


def _check_rank(name: str, rank: int, tp: int) -> None:
    if not 0 <= rank < tp:
        raise ValueError(f"{name}={rank} is outside [0, {tp})")


def _check_paired(src_tp: int, dst_tp: int, src_rank: int, dst_rank: int) -> None:
    _check_rank("src_rank", src_rank, src_tp)
    _check_rank("dst_rank", dst_rank, dst_tp)
    paired = (
        src_rank == dst_rank // (dst_tp // src_tp) if src_tp <= dst_tp else dst_rank == src_rank // (src_tp // dst_tp)
    )
    if not paired:
        raise ValueError(f"src rank {src_rank} of tp={src_tp} does not pair with dst rank {dst_rank} of tp={dst_tp}")


def should_send_replicated(src_tp: int, dst_tp: int, src_rank: int) -> bool:
    """Whether source rank ``src_rank`` writes a replicated state.

    On scatter (src_tp <= dst_tp) every source writes (a broadcast to the ranks it serves); on
    aggregation exactly one of the ``src_tp // dst_tp`` equal copies is written: rank s writes
    iff ``s % (src_tp // dst_tp) == 0``. ValueError on sizes < 1, non-dividing sizes, or a rank
    outside ``[0, src_tp)``.
    """
    _check_tp(src_tp, dst_tp)
    _check_rank("src_rank", src_rank, src_tp)
    return src_tp <= dst_tp or src_rank % (src_tp // dst_tp) == 0


def should_send_head(src_tp: int, dst_tp: int, src_rank: int, total_heads: int) -> bool:
    """Whether source rank ``src_rank`` writes its KV heads (election among head replicas).

    With ``r = src_tp // total_heads`` replicas per head (1 when tp <= heads), among the
    ``src_tp // dst_tp`` sources of one decode rank those holding the same head elect the
    lowest: s writes iff ``s % min(src_tp // dst_tp, r) == 0``. On scatter every source writes.
    """
    _check_tp(src_tp, dst_tp)
    _check_rank("src_rank", src_rank, src_tp)
    if total_heads < 1 or (total_heads % src_tp and src_tp % total_heads):
        raise ValueError(f"src_tp={src_tp} and total_heads={total_heads} must divide one another")
    if src_tp <= dst_tp:
        return True
    replicas = max(1, src_tp // total_heads)
    return src_rank % min(src_tp // dst_tp, replicas) == 0


def _merge_adjacent(blocks: Iterable[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    out: list[tuple[int, int, int]] = []
    for s, d, n in blocks:
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            ps, pd, pn = out[-1]
            out[-1] = (ps, pd, pn + n)
        else:
            out.append((s, d, n))
    return out


def slice_blocks(
    *,
    src_item_len: int,
    dst_item_len: int,
    src_dim: int,
    dst_dim: int,
    outer_count: int,
    src_tp: int,
    dst_tp: int,
    src_rank: int,
    dst_rank: int,
    shard_groups: Sequence[int] | None = None,
    group_heads: Sequence[int] | None = None,
) -> list[tuple[int, int, int]]:
    """Blocks ``(src offset, dst offset, length)`` in bytes within one slot, for one rank pair.

    An item is ``outer_count`` rows of ``dim`` units along its sliceable dim; ``src_dim`` and
    ``dst_dim`` are per-rank dims. Scatter (src_tp <= dst_tp): the decode rank reads the slice
    ``[(dst_rank * dd) % sd, +dd)`` of its source's dim. Aggregation: the source writes its whole
    slice at ``(src_rank % (src_tp // dst_tp)) * sd``. ``shard_groups`` (global widths in units,
    e.g. the q, k, v conv channels) are each sliced on their own; every block repeats for each
    outer row. Blocks adjacent on both sides are merged, so equal TP gives one whole-item block.

    ``group_heads`` (declared groups, ``layouts.ConvGroup``) gives each group's heads: a group whose heads TP
    does not divide is replicated, one head per rank (``group_range``); each destination range is written by
    the lowest paired source holding it (``_replicable_group_blocks``).

    Dim 0 on both sides means replicated: equal item lengths are required; an elected source
    gets one whole-item block, a source that is not elected gets ``[]``. Dim 0 on one side only,
    unequal replicated lengths, sizes that do not divide, or ranks that do not pair raise ValueError.
    """
    _check_tp(src_tp, dst_tp)
    _check_paired(src_tp, dst_tp, src_rank, dst_rank)
    if src_item_len < 1 or dst_item_len < 1:
        raise ValueError(f"item lengths must be positive, got {src_item_len} and {dst_item_len}")
    if src_dim == 0 or dst_dim == 0:
        if src_dim != dst_dim:
            raise ValueError(f"replicated on one side only: src_dim={src_dim}, dst_dim={dst_dim}")
        if src_item_len != dst_item_len:
            raise ValueError(f"replicated item lengths differ: src {src_item_len}, dst {dst_item_len}")
        return [(0, 0, src_item_len)] if should_send_replicated(src_tp, dst_tp, src_rank) else []
    if src_dim < 0 or dst_dim < 0 or outer_count < 1:
        raise ValueError(f"dims and outer_count must be positive: {src_dim}, {dst_dim}, {outer_count}")
    if group_heads is not None:
        return _replicable_group_blocks(src_item_len, dst_item_len, src_dim, dst_dim, outer_count, src_tp, dst_tp,
                                        src_rank, dst_rank, tuple(shard_groups or ()), tuple(group_heads))
    if src_dim * src_tp != dst_dim * dst_tp:
        raise ValueError(f"global dims differ: {src_dim}x{src_tp} != {dst_dim}x{dst_tp}")
    if src_item_len % (outer_count * src_dim) or dst_item_len % (outer_count * dst_dim):
        raise ValueError(f"item lengths {src_item_len}, {dst_item_len} are not rows of dims {src_dim}, {dst_dim}")
    unit = src_item_len // (outer_count * src_dim)
    if unit != dst_item_len // (outer_count * dst_dim):
        raise ValueError(f"unit sizes differ: {unit} vs {dst_item_len // (outer_count * dst_dim)}")
    groups = tuple(shard_groups) if shard_groups else (src_dim * src_tp,)
    if sum(groups) != src_dim * src_tp or any(g < 1 or g % src_tp or g % dst_tp for g in groups):
        raise ValueError(f"shard groups {groups} must sum to {src_dim * src_tp} and divide by both TP sizes")
    blocks: list[tuple[int, int, int]] = []
    src_row, dst_row = src_dim * unit, dst_dim * unit
    for o in range(outer_count):
        s_start = d_start = 0
        for g in groups:
            gs, gd = g // src_tp, g // dst_tp
            if src_tp <= dst_tp:
                s, d, n = s_start + (dst_rank * gd) % gs, d_start, gd
            else:
                s, d, n = s_start, d_start + (src_rank % (src_tp // dst_tp)) * gs, gs
            blocks.append((o * src_row + s * unit, o * dst_row + d * unit, n * unit))
            s_start += gs
            d_start += gd
    return _merge_adjacent(blocks)


def _replicable_group_blocks(src_item_len: int, dst_item_len: int, src_dim: int, dst_dim: int, outer_count: int,
                             src_tp: int, dst_tp: int, src_rank: int, dst_rank: int, groups: tuple[int, ...],
                             heads: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """``slice_blocks`` for declared groups: per group, the overlap of what the source holds with what the
    destination holds; on aggregation a replicated range is written only by the lowest paired source that
    holds it (writer election, as ``should_send_head`` does for KV heads)."""
    if len(groups) != len(heads) or not groups:
        raise ValueError(f"shard groups {groups} and group heads {heads} must pair up")
    if sum(group_range(g, h, src_tp, 0)[1] for g, h in zip(groups, heads, strict=True)) != src_dim or \
            sum(group_range(g, h, dst_tp, 0)[1] for g, h in zip(groups, heads, strict=True)) != dst_dim:
        raise ValueError(f"per-rank dims {src_dim}, {dst_dim} are not the groups' shares {groups} x {heads}")
    if src_item_len % (outer_count * src_dim) or dst_item_len % (outer_count * dst_dim):
        raise ValueError(f"item lengths {src_item_len}, {dst_item_len} are not rows of dims {src_dim}, {dst_dim}")
    unit = src_item_len // (outer_count * src_dim)
    if unit != dst_item_len // (outer_count * dst_dim):
        raise ValueError(f"unit sizes differ: {unit} vs {dst_item_len // (outer_count * dst_dim)}")
    peers = range(src_rank) if src_tp <= dst_tp else range(dst_rank * (src_tp // dst_tp), src_rank)
    blocks: list[tuple[int, int, int]] = []
    for o in range(outer_count):
        s_base = d_base = 0
        for g, h in zip(groups, heads, strict=True):
            s0, sn = group_range(g, h, src_tp, src_rank)
            d0, dn = group_range(g, h, dst_tp, dst_rank)
            lo, hi = max(s0, d0), min(s0 + sn, d0 + dn)
            elected = src_tp <= dst_tp or all(group_range(g, h, src_tp, p) != (s0, sn) for p in peers)
            if lo < hi and elected:
                blocks.append((o * src_dim * unit + (s_base + lo - s0) * unit,
                               o * dst_dim * unit + (d_base + lo - d0) * unit, (hi - lo) * unit))
            s_base += sn
            d_base += dn
    return _merge_adjacent(blocks)


def _first_head(rank: int, tp: int, heads: int) -> int:
    return (rank // max(1, tp // heads)) * max(1, heads // tp)


def head_blocks(
    *, head_bytes: int, total_heads: int, src_tp: int, dst_tp: int, src_rank: int, dst_rank: int
) -> list[tuple[int, int, int]]:
    """Blocks within one head-major KV page: heads, not bytes, are sliced.

    A rank holds ``max(1, H // tp)`` heads; when tp > H rank s holds head ``s // (tp // H)``.
    Scatter: the decode rank takes its heads from its one source. Aggregation: elected sources
    (``should_send_head``) write their heads into the destination's slots for them.
    """
    _check_tp(src_tp, dst_tp)
    _check_paired(src_tp, dst_tp, src_rank, dst_rank)
    h = total_heads
    if not should_send_head(src_tp, dst_tp, src_rank, h):
        return []
    if h % dst_tp and dst_tp % h:
        raise ValueError(f"dst_tp={dst_tp} and total_heads={h} must divide one another")
    sh, dh = max(1, h // src_tp), max(1, h // dst_tp)
    s0, d0 = _first_head(src_rank, src_tp, h), _first_head(dst_rank, dst_tp, h)
    if src_tp <= dst_tp:
        return [((d0 - s0) * head_bytes, 0, dh * head_bytes)]
    return [(0, (s0 - d0) * head_bytes, sh * head_bytes)]


# --------------------------------------------------------------------------- pairing


def pair_entries(
    src_layer_ids: Sequence[int | None],
    dst_layer_ids: Sequence[int | None],
    allow_positional: bool = False,
) -> list[tuple[int, int]]:
    """Pair source and destination entries of one (state type, field) group by layer id.

    Returns ``(source position, destination position)`` pairs in source order. Repeated ids pair
    in order of occurrence. A source id the destination lacks (or holds fewer times) raises;
    destination ids no source sends are left to the caller (decode PP 1 holds every stage's
    layers). An id of ``None`` means the side did not publish layer ids: ids published by only
    one side raise unless ``allow_positional``, which pairs by position and needs equal lengths
    (and equal ids wherever both are known). An empty source pairs nothing.
    """
    if not src_layer_ids:
        return []
    src_known = [i is not None for i in src_layer_ids]
    dst_known = [i is not None for i in dst_layer_ids]
    if all(src_known) and all(dst_known):
        where: dict[int, list[int]] = defaultdict(list)
        for pos, lid in enumerate(dst_layer_ids):
            assert lid is not None
            where[lid].append(pos)
        used: dict[int, int] = defaultdict(int)
        out = []
        for pos, lid in enumerate(src_layer_ids):
            assert lid is not None
            k = used[lid]
            if k >= len(where.get(lid, ())):
                have = len(where.get(lid, ()))
                raise ValueError(f"source layer id {lid} (occurrence {k + 1}) has no destination entry "
                                 f"(destination holds it {have} time(s))")
            used[lid] = k + 1
            out.append((pos, where[lid][k]))
        return out
    if not allow_positional:
        raise ValueError("layer ids published by only one side; id pairing impossible and positional "
                         "pairing not allowed (needs PP 1 on both sides and identical order)")
    if len(src_layer_ids) != len(dst_layer_ids):
        raise ValueError(f"positional pairing needs equal entry counts, got {len(src_layer_ids)} "
                         f"and {len(dst_layer_ids)}")
    for pos, (a, b) in enumerate(zip(src_layer_ids, dst_layer_ids, strict=True)):
        if a is not None and b is not None and a != b:
            raise ValueError(f"positional pairing at position {pos} pairs layer {a} with layer {b}")
    return [(i, i) for i in range(len(src_layer_ids))]


def check_shapes(src: ParallelShape, dst: ParallelShape) -> None:
    """The shape rules every backend shares: TP sizes divide each other; decode PP == prefill PP or 1."""
    if max(src.tp, dst.tp) % min(src.tp, dst.tp):
        raise PlanError(f"prefill tp={src.tp} and decode tp={dst.tp} must divide one another", rule="tp-divides")
    if dst.pp not in (src.pp, 1):
        raise PlanError(f"decode pp={dst.pp} must equal prefill pp={src.pp} or be 1", rule="pp-equal-or-one")


def source_ranks(src: ParallelShape, dst: ParallelShape, dst_tp_rank: int, dst_pp_rank: int) -> list[tuple[int, int]]:
    """The prefill ranks ``(tp_rank, pp_rank)`` a decode rank must hear from (each reports a status)."""
    check_shapes(src, dst)
    if not (0 <= dst_tp_rank < dst.tp and 0 <= dst_pp_rank < dst.pp):
        raise PlanError(f"decode rank (tp {dst_tp_rank}, pp {dst_pp_rank}) is outside {dst}")
    stages = [dst_pp_rank] if dst.pp == src.pp else list(range(src.pp))
    if src.tp <= dst.tp:
        tps = [dst_tp_rank // (dst.tp // src.tp)]
    else:
        k = src.tp // dst.tp
        tps = list(range(dst_tp_rank * k, (dst_tp_rank + 1) * k))
    return [(t, p) for p in stages for t in tps]


def elect_sentinel_stages(sources: Iterable[RankRegistration]) -> dict[tuple[StateType, EntryField], int]:
    """For each sentinel (state, field), the lowest source PP stage that holds it."""
    out: dict[tuple[StateType, EntryField], int] = {}
    for reg in sources:
        for b in reg.buffers:
            if is_sentinel(b.spec.layer_id):
                key = b.spec.key
                out[key] = min(out.get(key, reg.pp_rank), reg.pp_rank)
    return out


# --------------------------------------------------------------------------- blocks


@dataclass(frozen=True)
class Blocks:
    """Byte blocks ``(src address, dst address, length)``, int64, with the state type of each (``STATE_ORDER``).

    The one block type: the planner makes it, engines take it (``engines.blocks.checked`` validates it
    at the adapter). ``state`` is None for blocks nobody planned (an engine test's scratch writes).
    """

    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray
    state: np.ndarray | None = None

    @staticmethod
    def empty() -> Blocks:
        z = np.zeros(0, dtype=np.int64)
        return Blocks(z, z, z, np.zeros(0, dtype=np.uint8))

    @staticmethod
    def concat(parts: Sequence[Blocks]) -> Blocks:
        if not parts:
            return Blocks.empty()
        states = [p.state for p in parts if p.state is not None]
        return Blocks(np.concatenate([p.src for p in parts]), np.concatenate([p.dst for p in parts]),
                      np.concatenate([p.length for p in parts]),
                      np.concatenate(states) if len(states) == len(parts) else None)

    @property
    def descriptors(self) -> int:
        return int(self.length.size)

    @property
    def bytes(self) -> int:
        return int(self.length.sum())

    def bytes_by_state(self) -> dict[str, int]:
        if self.state is None:
            return {}
        sums = np.bincount(self.state, weights=self.length, minlength=len(STATE_ORDER))
        return {s.value: int(sums[i]) for i, s in enumerate(STATE_ORDER) if sums[i]}

    def take(self, sel: np.ndarray | slice) -> Blocks:
        return Blocks(self.src[sel], self.dst[sel], self.length[sel], None if self.state is None else self.state[sel])

    def chunks(self, max_entries: int) -> Iterator[Blocks]:
        """Consecutive slices of at most ``max_entries`` blocks (views, no copies)."""
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        for start in range(0, self.descriptors, max_entries):
            yield self.take(slice(start, start + max_entries))


def coalesce(blocks: Blocks) -> Blocks:
    """Merge consecutive blocks that are contiguous on both sides and of one state type (vectorized)."""
    n = blocks.descriptors
    if n < 2:
        return blocks
    end_s = blocks.src[:-1] + blocks.length[:-1]
    end_d = blocks.dst[:-1] + blocks.length[:-1]
    join = (end_s == blocks.src[1:]) & (end_d == blocks.dst[1:])
    if blocks.state is not None:
        join &= blocks.state[:-1] == blocks.state[1:]
    starts = np.flatnonzero(np.concatenate(([True], ~join)))
    return Blocks(blocks.src[starts], blocks.dst[starts], np.add.reduceat(blocks.length, starts),
                  None if blocks.state is None else blocks.state[starts])


# --------------------------------------------------------------------------- compiled pair


@dataclass(frozen=True)
class _Segments:
    """All paired buffers of one index kind, as parallel arrays (one row per in-item block)."""

    kind: IndexKind
    whole: np.ndarray  # bool: block is the whole item on both sides
    src_base: np.ndarray  # buffer address + in-item offset
    dst_base: np.ndarray
    src_item: np.ndarray
    dst_item: np.ndarray
    length: np.ndarray
    state: np.ndarray
    src_count: int  # smallest item count among the buffers
    dst_count: int
    first: tuple[StateType, int]  # a (state type, layer) named in errors

    @property
    def n_whole(self) -> int:
        return int(self.whole.sum())


def _blocks_for(src_rec: BufferRecord, dst_rec: BufferRecord, src: RankRegistration,
                dst: RankRegistration) -> list[tuple[int, int, int]]:
    a, b = src_rec.spec, dst_rec.spec
    try:
        if a.sharding != b.sharding:
            raise ValueError(f"sharding differs: {a.sharding.value} {a.item_shape} vs {b.sharding.value} {b.item_shape}")
        if a.sharding is Sharding.HEADS:
            if a.unit_bytes != b.unit_bytes or a.total_heads != b.total_heads:
                raise ValueError(f"head pages differ: {a.unit_bytes}B x {a.total_heads} vs {b.unit_bytes}B x {b.total_heads}")
            return head_blocks(head_bytes=a.unit_bytes, total_heads=a.total_heads, src_tp=src.shape.tp,
                               dst_tp=dst.shape.tp, src_rank=src.tp_rank, dst_rank=dst.tp_rank)
        if a.outer_count != b.outer_count or a.shard_groups != b.shard_groups or a.group_heads != b.group_heads:
            raise ValueError(f"outer counts or shard groups differ: {a.outer_count}/{a.shard_groups}/{a.group_heads} "
                             f"vs {b.outer_count}/{b.shard_groups}/{b.group_heads}")
        return slice_blocks(src_item_len=a.item_bytes, dst_item_len=b.item_bytes, src_dim=a.dim, dst_dim=b.dim,
                            outer_count=a.outer_count, src_tp=src.shape.tp, dst_tp=dst.shape.tp,
                            src_rank=src.tp_rank, dst_rank=dst.tp_rank, shard_groups=a.shard_groups,
                            group_heads=a.group_heads)
    except ValueError as e:
        raise PlanError(f"{a.describe()} from {src.label()} to {dst.label()}: {e}",
                        state_type=a.state_type, layer_id=a.layer_id) from e


@dataclass(frozen=True)
class PairPlan:
    """The compiled, request-independent plan between one source and one destination rank."""

    src_rank: int
    dst_rank: int
    segments: tuple[_Segments, ...]
    pairs: tuple[tuple[BufferRecord, BufferRecord, tuple[tuple[int, int, int], ...]], ...]

    def plan(self, src_idx: RequestIndices, dst_idx: RequestIndices) -> Blocks:
        """Blocks for one request, given its items on the source and destination instances."""
        prepared = {seg.kind: _prepare(seg, src_idx.of(seg.kind), dst_idx.of(seg.kind)) for seg in self.segments}
        return self._plan_prepared(prepared)

    def _plan_prepared(self, prepared: Mapping[IndexKind, _Prepared]) -> Blocks:
        """Fill preallocated arrays in place: the cost is the descriptors written, not temporaries."""
        sizes = [_kind_size(seg, prepared[seg.kind]) for seg in self.segments]
        total = sum(w + p for w, p in sizes)
        out = Blocks(np.empty(total, np.int64), np.empty(total, np.int64), np.empty(total, np.int64),
                     np.empty(total, np.uint8))
        pos = 0
        for seg, (w, p) in zip(self.segments, sizes, strict=True):
            _fill_kind(seg, prepared[seg.kind], out, pos, w)
            pos += w + p
        return out


@dataclass(frozen=True)
class _Prepared:
    """A request's checked index arrays of one kind and their runs (consecutive on both sides)."""

    si: np.ndarray
    di: np.ndarray
    run_starts: np.ndarray
    run_lengths: np.ndarray


def _prepare(seg: _Segments, si: np.ndarray, di: np.ndarray) -> _Prepared:
    """Check one kind's index arrays against ``seg`` (lengths, ranges, repeats) and find its runs."""
    state, layer = seg.first
    if si.size != di.size:
        raise PlanError(f"{seg.kind.value} index lists differ in length: source {si.size}, destination {di.size}",
                        state_type=state, layer_id=layer)
    for side, arr, count in (("source", si, seg.src_count), ("destination", di, seg.dst_count)):
        if arr.size and (arr.min() < 0 or arr.max() >= count):
            bad = arr[(arr < 0) | (arr >= count)][:8]
            raise PlanError(f"{side} {seg.kind.value} indices outside [0, {count})", state_type=state,
                            layer_id=layer, indices=bad)
        if arr.size > 1:
            srt = np.sort(arr)
            dup = srt[1:][srt[1:] == srt[:-1]]
            if dup.size:
                raise PlanError(f"{side} {seg.kind.value} indices repeat", state_type=state, layer_id=layer,
                                indices=np.unique(dup)[:8])
    n = si.size
    brk = np.flatnonzero((np.diff(si) != 1) | (np.diff(di) != 1)) + 1
    starts = np.concatenate(([0], brk)) if n else np.zeros(0, dtype=np.int64)
    return _Prepared(si, di, starts, np.diff(np.append(starts, n)))


def _kind_size(seg: _Segments, pr: _Prepared) -> tuple[int, int]:
    """Descriptors of one kind: whole-item segments x runs, partial blocks x items."""
    if pr.si.size == 0:
        return 0, 0
    return seg.n_whole * pr.run_starts.size, (seg.whole.size - seg.n_whole) * pr.si.size


def _fill(dst: np.ndarray, base: np.ndarray, idx: np.ndarray, item: np.ndarray) -> None:
    """dst (viewed as [len(base), len(idx)]) = base[:, None] + idx[None, :] * item[:, None], in place."""
    view = dst.reshape(base.size, idx.size)
    np.multiply(idx[None, :], item[:, None], out=view)
    view += base[:, None]


def _fill_kind(seg: _Segments, pr: _Prepared, out: Blocks, pos: int, n_whole_blocks: int) -> None:
    n = pr.si.size
    if n == 0:
        return
    state = out.state
    assert state is not None  # the planner's own blocks always carry their state types
    w, p = seg.whole, ~seg.whole
    if seg.n_whole:
        runs, end = pr.run_starts.size, pos + n_whole_blocks
        _fill(out.src[pos:end], seg.src_base[w], pr.si[pr.run_starts], seg.src_item[w])
        _fill(out.dst[pos:end], seg.dst_base[w], pr.di[pr.run_starts], seg.dst_item[w])
        np.multiply(pr.run_lengths[None, :], seg.src_item[w][:, None], out=out.length[pos:end].reshape(-1, runs))
        state[pos:end].reshape(-1, runs)[:] = seg.state[w][:, None]
        pos = end
    m = seg.whole.size - seg.n_whole
    if m:
        end = pos + m * n
        _fill(out.src[pos:end], seg.src_base[p], pr.si, seg.src_item[p])
        _fill(out.dst[pos:end], seg.dst_base[p], pr.di, seg.dst_item[p])
        out.length[pos:end].reshape(m, n)[:] = seg.length[p][:, None]
        state[pos:end].reshape(m, n)[:] = seg.state[p][:, None]


def compile_pair(
    src: RankRegistration,
    dst: RankRegistration,
    *,
    sentinel_stages: Mapping[tuple[StateType, EntryField], int] | None = None,
) -> PairPlan:
    """Pair the buffers of one (source, destination) rank pair and slice them.

    ``sentinel_stages`` (from ``elect_sentinel_stages`` over all sources of ``dst``) says which
    source stage sends each sentinel state; None means this source is the only stage.
    """
    check_shapes(src.shape, dst.shape)
    allow_positional = src.shape.pp == 1 and dst.shape.pp == 1
    groups_src: dict[tuple[StateType, EntryField], list[BufferRecord]] = defaultdict(list)
    groups_dst: dict[tuple[StateType, EntryField], list[BufferRecord]] = defaultdict(list)
    for b in src.buffers:
        groups_src[b.spec.key].append(b)
    for b in dst.buffers:
        groups_dst[b.spec.key].append(b)
    pairs = []
    for key, sbufs in groups_src.items():
        dbufs = groups_dst.get(key, [])

        def ids(reg: RankRegistration, bufs: list[BufferRecord]) -> list[int | None]:
            return [b.spec.layer_id if reg.publishes_layer_ids else None for b in bufs]

        try:
            matched = pair_entries(ids(src, sbufs), ids(dst, dbufs), allow_positional)
        except ValueError as e:
            raise PlanError(f"pairing {key[0].value}/{key[1].value} from {src.label()} to {dst.label()}: {e}",
                            state_type=key[0], layer_id=sbufs[0].spec.layer_id) from e
        for i, j in matched:
            a, b = sbufs[i], dbufs[j]
            if is_sentinel(a.spec.layer_id) and (sentinel_stages or {}).get(key, src.pp_rank) != src.pp_rank:
                continue
            if a.spec.dtype != b.spec.dtype:
                # Bytes of one element type read as another: equal item sizes (bfloat16 and float16) would move
                # and decode would compute on them, nothing failing (the SGLang contract's pair across a
                # KV-dtype rollout did: docs/router.md).
                raise PlanError(f"{key[0].value}/{key[1].value} is {a.spec.dtype.value} on {src.label()} and "
                                f"{b.spec.dtype.value} on {dst.label()}: both roles must keep state in one dtype",
                                state_type=key[0], layer_id=a.spec.layer_id, rule="dtype-equal")
            blocks = _blocks_for(a, b, src, dst)
            if blocks:
                pairs.append((a, b, tuple(blocks)))
    return PairPlan(src.rank, dst.rank, _build_segments(pairs), tuple(pairs))


def _build_segments(pairs: Sequence[tuple[BufferRecord, BufferRecord, tuple[tuple[int, int, int], ...]]]
                    ) -> tuple[_Segments, ...]:
    rows: dict[IndexKind, list[tuple]] = defaultdict(list)
    for a, b, blocks in pairs:
        whole = len(blocks) == 1 and blocks[0] == (0, 0, a.item_bytes) and a.item_bytes == b.item_bytes
        for so, do, n in blocks:
            rows[a.spec.index].append((whole, a.address + so, b.address + do, a.item_bytes, b.item_bytes, n,
                                       _STATE_CODE[a.spec.state_type], a.count, b.count,
                                       (a.spec.state_type, a.spec.layer_id)))
    out = []
    for kind, r in rows.items():
        cols = list(zip(*r, strict=True))
        src_base, dst_base, src_item, dst_item, length = (np.array(c, dtype=np.int64) for c in cols[1:6])
        out.append(_Segments(
            kind, np.array(cols[0], dtype=bool), src_base, dst_base, src_item, dst_item, length,
            np.array(cols[6], dtype=np.uint8), min(cols[7]), min(cols[8]), cols[9][0],
        ))
    return tuple(out)


# --------------------------------------------------------------------------- destination


@dataclass(frozen=True)
class DestinationPlan:
    """Every pair plan of one decode rank; ``sources`` are the ranks it must hear a status from."""

    dst_rank: int
    sources: tuple[int, ...]
    pairs: tuple[PairPlan, ...]
    _widest: tuple[_Segments, ...] = ()  # per index kind: smallest counts over all pairs, for the checks

    def plan(self, src_idx: RequestIndices, dst_idx: RequestIndices) -> dict[int, Blocks]:
        """Blocks per source rank for one request (a source with nothing to send maps to empty blocks).

        Index checks and runs are computed once per index kind, against the smallest pool of any pair.
        """
        prepared = {seg.kind: _prepare(seg, src_idx.of(seg.kind), dst_idx.of(seg.kind)) for seg in self._widest}
        return {p.src_rank: p._plan_prepared(prepared) for p in self.pairs}


def compile_destination(dst: RankRegistration, sources: Sequence[RankRegistration]) -> DestinationPlan:
    """Compile the plans of one decode rank and check that they fill each of its buffers exactly once.

    ``sources`` must be exactly the registrations ``source_ranks`` names. The coverage check
    catches a decode layer no stage sends, and two sources writing the same bytes.
    """
    if not sources:
        raise PlanError(f"{dst.label()} has no source registrations")
    src_shape = sources[0].shape
    want = sorted(source_ranks(src_shape, dst.shape, dst.tp_rank, dst.pp_rank))
    have = sorted((s.tp_rank, s.pp_rank) for s in sources)
    if want != have or any(s.shape != src_shape for s in sources):
        raise PlanError(f"{dst.label()} must pair with prefill ranks (tp, pp) {want}, got {have}")
    stages = elect_sentinel_stages(sources)
    pairs = tuple(compile_pair(s, dst, sentinel_stages=stages) for s in sources)
    _check_coverage(dst, pairs)
    checks: dict[IndexKind, _Segments] = {}
    for p in pairs:
        for seg in p.segments:
            widest = checks.get(seg.kind)
            if widest is None or (seg.src_count, seg.dst_count) < (widest.src_count, widest.dst_count):
                checks[seg.kind] = seg if widest is None else replace(
                    widest, src_count=min(widest.src_count, seg.src_count),
                    dst_count=min(widest.dst_count, seg.dst_count))
    return DestinationPlan(dst.rank, tuple(p.src_rank for p in pairs), pairs, tuple(checks.values()))


def _check_coverage(dst: RankRegistration, pairs: Sequence[PairPlan]) -> None:
    got: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for p in pairs:
        for _, b, blocks in p.pairs:
            got[b.address].extend((do, do + n) for _, do, n in blocks)
    for b in dst.buffers:
        spans = sorted(got.get(b.address, []))
        pos = 0
        for lo, hi in spans:
            if lo != pos:
                what = "is written twice" if lo < pos else "is never written"
                offset = lo if lo < pos else pos
                raise PlanError(f"{b.spec.describe()} on {dst.label()}: byte {offset} of each item {what}",
                                state_type=b.spec.state_type, layer_id=b.spec.layer_id)
            pos = hi
        if pos != b.item_bytes:
            raise PlanError(f"{b.spec.describe()} on {dst.label()}: bytes {pos}..{b.item_bytes} of each item are "
                            "never written", state_type=b.spec.state_type, layer_id=b.spec.layer_id)

"""Registration records and request indices: the pure data the planner works on.

Pools (torch) produce these; the planner (numpy) and the wire protocol consume them, so this
module imports neither torch nor an engine. A rank registers one region (its pool arena) with
the transfer engine once; each buffer inside it is a ``BufferRecord`` carrying
``(address, total bytes, item bytes)`` plus the ``BufferSpec`` metadata (state type, field,
layer id, sharding, dims).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from pdfleet_runtime.ids import RankId, RowId, SlotId
from pdfleet_runtime.layouts import (
    BufferSpec,
    IndexKind,
    Layout,
    LayoutError,
    arena_offsets,
    pool_counts,
    rank_buffers,
)

__all__ = [
    "BufferRecord", "ParallelShape", "RankRegistration", "RegionRecord", "RequestIndices", "virtual_registration",
]


@dataclass(frozen=True, order=True)
class ParallelShape:
    """The (tp, pp) shape of one role (prefill or decode): the one shape type of the runtime.

    In a pydantic model (the runtime config) it reads and writes ``{tensor, pipeline}`` (each 1..64,
    ``pipeline`` defaulting to 1), the names the operator writes.
    """

    tp: int
    pp: int = 1

    MAX_RANKS = 64
    """The most ranks per dimension a runtime config may name."""

    @classmethod
    def __get_pydantic_core_schema__(cls, source: object, handler: object) -> object:
        from pydantic_core import core_schema as cs

        dim = cs.int_schema(ge=1, le=cls.MAX_RANKS)
        wire = cs.typed_dict_schema({"tensor": cs.typed_dict_field(dim),
                                     "pipeline": cs.typed_dict_field(dim, required=False)}, extra_behavior="forbid")
        return cs.no_info_before_validator_function(
            lambda v: {"tensor": v.tp, "pipeline": v.pp} if isinstance(v, cls) else v,
            cs.no_info_after_validator_function(lambda d: cls(d["tensor"], d.get("pipeline", 1)), wire),
            serialization=cs.plain_serializer_function_ser_schema(lambda s: {"tensor": s.tp, "pipeline": s.pp}))

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1:
            raise LayoutError(f"tp and pp must be at least 1, got tp={self.tp}, pp={self.pp}")

    @classmethod
    def parse(cls, text: str) -> ParallelShape:
        """Parse ``tp=4,pp=2`` (pp defaults to 1)."""
        values: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            m = re.fullmatch(r"(tp|pp)\s*=\s*(\d+)", part)
            if m is None or m.group(1) in values:
                raise LayoutError(f"cannot parse shape {text!r}: expected 'tp=N[,pp=M]'")
            values[m.group(1)] = int(m.group(2))
        if "tp" not in values:
            raise LayoutError(f"cannot parse shape {text!r}: tp is required")
        return cls(values["tp"], values.get("pp", 1))

    @property
    def world(self) -> int:
        return self.tp * self.pp

    def rank(self, tp_rank: int, pp_rank: int) -> RankId:
        return RankId(pp_rank * self.tp + tp_rank)

    def coords(self) -> list[tuple[int, int]]:
        """Every (tp_rank, pp_rank), in global rank order."""
        return [(t, p) for p in range(self.pp) for t in range(self.tp)]

    def __str__(self) -> str:
        return f"tp={self.tp},pp={self.pp}"


@dataclass(frozen=True)
class RegionRecord:
    """One memory region registered with the engine once: a rank's pool arena."""

    address: int
    total_bytes: int
    device: str


@dataclass(frozen=True)
class BufferRecord:
    """One buffer inside a region: ``count`` items of ``spec.item_bytes`` starting at ``address``."""

    spec: BufferSpec
    address: int
    count: int

    @property
    def item_bytes(self) -> int:
        return self.spec.item_bytes

    @property
    def total_bytes(self) -> int:
        return self.count * self.spec.item_bytes


@dataclass(frozen=True)
class RankRegistration:
    """What a rank publishes at start: its place in its role's shape and every buffer it holds.

    ``publishes_layer_ids`` is False for engines whose handshake carries no per-buffer layer ids
    (MORI); the planner then pairs by position, which is only allowed when both sides have PP 1.
    """

    shape: ParallelShape
    tp_rank: int
    pp_rank: int
    region: RegionRecord
    buffers: tuple[BufferRecord, ...]
    publishes_layer_ids: bool = True

    @property
    def rank(self) -> RankId:
        return self.shape.rank(self.tp_rank, self.pp_rank)

    def label(self) -> str:
        return f"rank {self.rank} (tp {self.tp_rank}, pp {self.pp_rank})"


def _as_index_array(values: object) -> np.ndarray:
    arr = np.asarray(values, dtype=np.int64).reshape(-1)
    arr.setflags(write=False)
    return arr


@dataclass(frozen=True)
class RequestIndices:
    """The items one request occupies on one instance (the same ids on every rank of it).

    ``pages`` index the KV page pool (and QSA compressed pages), ``swa_pages`` the SWA pool;
    ``slot`` is the request's linear-attention/PLE slot and ``row`` its QSA request row.
    """

    pages: np.ndarray
    swa_pages: np.ndarray = field(default_factory=lambda: _as_index_array([]))
    slot: SlotId | None = None
    row: RowId | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "pages", _as_index_array(self.pages))
        object.__setattr__(self, "swa_pages", _as_index_array(self.swa_pages))

    def of(self, kind: IndexKind) -> np.ndarray:
        """The index array for one index kind (slot and row are arrays of length 0 or 1)."""
        if kind is IndexKind.PAGE:
            return self.pages
        if kind is IndexKind.SWA_PAGE:
            return self.swa_pages
        one = self.slot if kind is IndexKind.SLOT else self.row
        return _as_index_array([] if one is None else [one])


def virtual_registration(
    layout: Layout,
    shape: ParallelShape,
    tp_rank: int,
    pp_rank: int,
    max_requests: int,
    max_tokens: int,
    *,
    base: int = 1 << 40,
) -> RankRegistration:
    """A registration with made-up addresses (no memory): for planning benchmarks and pure tests.

    Buffers are laid out back to back from ``base`` as ``pools.RankPools`` would, without alignment.
    """
    counts = pool_counts(layout, max_requests, max_tokens)
    specs = rank_buffers(layout, shape.tp, shape.pp, tp_rank, pp_rank)
    offsets, total = arena_offsets(counts[s.index] * s.item_bytes for s in specs)
    records = tuple(BufferRecord(s, base + off, counts[s.index]) for s, off in zip(specs, offsets, strict=True))
    return RankRegistration(shape, tp_rank, pp_rank, RegionRecord(base, total, "virtual"), records)

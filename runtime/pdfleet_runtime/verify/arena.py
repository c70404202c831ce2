"""Arena checks of the in-process run: seeded background, a request's logical bytes written per rank, the comparison.

The harness's hands on the pools (torch): ``fill_background`` before a run, ``write_requests`` into
the prefill pools (or into numpy copies of decode arenas: what they must hold afterwards), and
``compare`` (every byte of an arena, so writes outside a request's pages, slots and rows show).
``fill_background`` and ``compare`` are the serving rank's own (``rank.arena``, what ``ArenaCheckOp``
runs in a rank process). ``LocalCopyExecutor`` moves planned blocks between arenas of one process.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from pdfleet_runtime.engines.local import RegionCopier
from pdfleet_runtime.planner import Blocks
from pdfleet_runtime.pools import RankPools
from pdfleet_runtime.rank.arena import compare, fill_background, item_rows
from pdfleet_runtime.rank.pipe import Mismatch
from pdfleet_runtime.records import RegionRecord, RequestIndices
from pdfleet_runtime.seeded import logical_items, shard_logical

__all__ = ["LocalCopyExecutor", "Mismatch", "compare", "fill_background", "write_requests"]


class LocalCopyExecutor:
    """Copies blocks between arenas of this process (cpu or cuda tensors) with the engines' ``RegionCopier``.

    Blocks are checked against the arenas with the engines' own ``RegionTable`` (``BlockRangeError``
    for a block outside every arena), then copied per block through tensor views, which also reach
    GPU memory (the ``local`` engine copies through numpy views of host memory).
    """

    def __init__(self, arenas: list[torch.Tensor]) -> None:
        regions = [RegionRecord(a.data_ptr(), a.numel(), str(a.device)) for a in arenas]
        self._copier = RegionCopier.within(regions, [a.numpy() if a.device.type == "cpu" else a for a in arenas])

    def execute(self, blocks: Blocks) -> None:
        self._copier.copy(blocks)


def write_requests(
    side: list[RankPools], seed: int, reqs: list[RequestIndices], targets: list[np.ndarray] | None
) -> None:
    """Write every request's logical bytes, sharded per rank, at its items on every rank of one side.

    Into the pools themselves when ``targets`` is None (prefill), else into ``targets`` (numpy
    copies of the arenas: the expected decode bytes). Each logical buffer is drawn once per
    request and sharded for every rank that holds it.
    """
    holders: dict[tuple[object, ...], list[tuple[int, int]]] = defaultdict(list)
    for r, pools in enumerate(side):
        for i, rec in enumerate(pools.records):
            holders[(rec.spec.state_type, rec.spec.field, rec.spec.layer_id)].append((r, i))
    for places in holders.values():
        first = side[places[0][0]]
        spec = first.records[places[0][1]].spec
        tp = first.shape.tp
        for q, idx in enumerate(reqs):
            items = idx.of(spec.index)
            if not items.size:
                continue
            logical = logical_items(seed, spec, tp, q, items.size)
            for r, i in places:
                pools = side[r]
                data = shard_logical(logical, spec, tp, pools.tp_rank)
                if targets is not None or pools.arena.device.type == "cpu":
                    arena = targets[r] if targets is not None else pools.arena.numpy()
                    item_rows(arena, pools, i)[items] = data
                else:
                    dev = pools.arena.device
                    pools.byte_view(i).index_copy_(0, torch.from_numpy(items.copy()).to(dev),
                                                   torch.from_numpy(data).to(dev))

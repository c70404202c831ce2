"""Synthetic request state: the prefill fills seeded bytes, the decode re-derives them and checks every one.

The bytes of a request are the parity harness's logical state (``seeded.logical_items``: per state
type, field and layer, drawn from the seed, independent of the shape) sharded for the rank that
holds them. So a prefill of any shape and a decode of any shape agree on what a request must hold
without talking, and a decode verifies exactly the request's items (pages, SWA pages, slot, row).
The seed is derived from the request id (``seeded.request_seed``), so stale bytes of an earlier request in
reused pages never pass as this request's.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from pdfleet_runtime.layouts import BufferSpec
from pdfleet_runtime.pools import RankPools
from pdfleet_runtime.records import RequestIndices
from pdfleet_runtime.seeded import logical_items, shard_logical

__all__ = ["corrupt_request", "fill_request", "mismatched_buffers", "request_bytes", "request_shards", "verify_request"]


def request_shards(pools: RankPools, seed: int, idx: RequestIndices) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """(buffer index, item ids, this rank's bytes for them) for every buffer the request occupies."""
    tp = pools.shape.tp
    for i, rec in enumerate(pools.records):
        spec: BufferSpec = rec.spec
        items = idx.of(spec.index)
        if items.size:
            yield i, items, shard_logical(logical_items(seed, spec, tp, 0, items.size), spec, tp, pools.tp_rank)


def fill_request(pools: RankPools, seed: int, idx: RequestIndices) -> int:
    """Write the request's seeded state into this rank's pools; the bytes written."""
    written = 0
    for i, items, data in request_shards(pools, seed, idx):
        view = pools.byte_view(i)
        ids = torch.from_numpy(np.array(items, dtype=np.int64)).to(view.device)
        view.index_copy_(0, ids, torch.from_numpy(data).to(view.device))
        written += data.size
    return written


def verify_request(pools: RankPools, seed: int, idx: RequestIndices) -> int:
    """Bytes of this rank's request items that differ from the seeded state (0: every byte arrived)."""
    return sum(mismatched_buffers(pools, seed, idx).values())


def mismatched_buffers(pools: RankPools, seed: int, idx: RequestIndices) -> dict[str, int]:
    """Per buffer (``BufferSpec.describe``) that differs from the seeded state, its differing bytes."""
    bad: dict[str, int] = {}
    for i, items, data in request_shards(pools, seed, idx):
        view = pools.byte_view(i)
        ids = torch.from_numpy(np.array(items, dtype=np.int64)).to(view.device)
        actual = view.index_select(0, ids).cpu().numpy()
        if n := int(np.count_nonzero(actual != data)):
            bad[pools.records[i].spec.describe()] = n
    return bad


def corrupt_request(pools: RankPools, idx: RequestIndices) -> None:
    """Fault injection (``--fault-corrupt-received``/``-sent``): flip the first byte of the request's first item."""
    for i, rec in enumerate(pools.records):
        items = idx.of(rec.spec.index)
        if items.size:
            pools.byte_view(i)[int(items[0]), :1].bitwise_not_()
            return


def request_bytes(pools: RankPools, idx: RequestIndices) -> int:
    """Bytes this rank holds for a request (what a transfer into it must move)."""
    return sum(int(idx.of(r.spec.index).size) * r.spec.item_bytes for r in pools.records)

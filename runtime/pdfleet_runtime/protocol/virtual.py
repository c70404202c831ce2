"""Wire messages of virtual peers (registrations at made-up addresses): for benchmarks, load tests and tests.

A ``PrefillRegister`` / ``DecodeRegister`` here carries a real layout's buffer records
(``records.virtual_registration``) at addresses no engine holds, so a bootstrap can be driven
without pools or engines: what it holds and sends is the same as for real ranks of that layout.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pdfleet_runtime.engines.base import PeerInfo  # a pure module: it imports no engine library
from pdfleet_runtime.ids import RowId, SlotId
from pdfleet_runtime.layouts import PRESETS, Layout
from pdfleet_runtime.records import ParallelShape, RegionRecord, RequestIndices, virtual_registration

from .messages import (
    DecodeRegister,
    IndicesModel,
    PrefillRegister,
    RankKey,
    RankModel,
    RequestKind,
    TransferRequest,
)

__all__ = ["decode_register", "engine_info", "prefill_register", "transfer_request"]

_DEFAULT = PRESETS["llama-dense"]


def engine_info(name: str, base: int = 1 << 40, size: int = 1 << 30) -> dict[str, Any]:
    return PeerInfo("mooncake", name, None, (RegionRecord(base, size, "cpu"),)).to_wire()


def prefill_register(shape: ParallelShape, tp: int, pp: int, name: str | None = None, *,
                     layout: Layout = _DEFAULT) -> PrefillRegister:
    reg = virtual_registration(layout, shape, tp, pp, 2, 64, base=(1 << 40) + (shape.rank(tp, pp) << 32))
    return PrefillRegister(rank=RankModel.of(reg), engine=engine_info(name or f"p{tp}{pp}", reg.region.address))


def decode_register(shape: ParallelShape, tp: int, pp: int, instance: str = "dec", name: str | None = None, *,
                    layout: Layout = _DEFAULT) -> DecodeRegister:
    reg = virtual_registration(layout, shape, tp, pp, 2, 64, base=(1 << 44) + (shape.rank(tp, pp) << 32))
    return DecodeRegister(instance=instance, rank=RankModel.of(reg),
                          engine=engine_info(name or f"d{tp}{pp}", reg.region.address))


def transfer_request(rid: str, tp: int = 0, pp: int = 0, instance: str = "dec", *,
                     kind: RequestKind = RequestKind.REQUEST, room: int | None = None) -> TransferRequest:
    return TransferRequest(request_id=rid, kind=kind, room=room, instance=instance, dst=RankKey(tp=tp, pp=pp),
                           indices=IndicesModel.of(RequestIndices(np.array([0, 1]), np.array([], dtype=np.int64), SlotId(0), RowId(0))), timeout_s=10.0)

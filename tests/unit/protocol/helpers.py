"""Builders shared by the protocol unit tests: a fake clock, codecs, registrations and messages."""

from __future__ import annotations

import copy
from typing import Any

from pdfleet_runtime.engines.base import PeerInfo
from pdfleet_runtime.layouts import PRESETS
from pdfleet_runtime.protocol.auth import Codec
from pdfleet_runtime.protocol.bootstrap import BootstrapState
from pdfleet_runtime.protocol.messages import (
    DecodeRegister,
    IndicesModel,
    PrefillRegister,
    RankKey,
    RankModel,
    TransferRequest,
)
from pdfleet_runtime.records import ParallelShape, RequestIndices, virtual_registration

SECRET = b"0123456789abcdef-test-secret"
RANK_KEY = b"rank-key-of-the-test-prefill-pod"
"""The test pod's rank key: its bootstrap's and its prefill ranks' codecs hold it (``protocol.keys``)."""
LAYOUT = PRESETS["llama-dense"]


class FakeClock:
    """Monotonic and wall clock in one, moved by hand."""

    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


def codec(sender: str = "test", clock: FakeClock | None = None, secret: bytes = SECRET) -> Codec:
    return Codec(secret, sender, clock=clock) if clock is not None else Codec(secret, sender)


def engine_info(name: str, base: int = 1 << 40, size: int = 1 << 30) -> dict[str, Any]:
    from pdfleet_runtime.records import RegionRecord

    return PeerInfo("mooncake", name, None, (RegionRecord(base, size, "cpu"),)).to_wire()


def prefill_register(shape: ParallelShape, tp: int, pp: int, name: str | None = None) -> PrefillRegister:
    reg = virtual_registration(LAYOUT, shape, tp, pp, 2, 64, base=(1 << 40) + (shape.rank(tp, pp) << 32))
    return PrefillRegister(rank=RankModel.of(reg), engine=engine_info(name or f"p{tp}{pp}", reg.region.address))


def decode_register(shape: ParallelShape, tp: int, pp: int, instance: str = "dec", name: str | None = None
                    ) -> DecodeRegister:
    reg = virtual_registration(LAYOUT, shape, tp, pp, 2, 64, base=(1 << 44) + (shape.rank(tp, pp) << 32))
    return DecodeRegister(instance=instance, rank=RankModel.of(reg),
                          engine=engine_info(name or f"d{tp}{pp}", reg.region.address))


def transfer_request(rid: str, tp: int = 0, pp: int = 0, instance: str = "dec") -> TransferRequest:
    return TransferRequest(request_id=rid, instance=instance, dst=RankKey(tp=tp, pp=pp),
                           indices=IndicesModel.of(RequestIndices([0, 1], [], 0, 0)), timeout_s=10.0)


def ready_state(p: ParallelShape, d: ParallelShape, clock: FakeClock) -> BootstrapState:
    """A pod with every prefill rank registered and every decode rank of instance ``dec`` registered."""
    st = BootstrapState(p, clock=clock)
    for t, k in p.coords():
        st.handle(prefill_register(p, t, k))
    for t, k in d.coords():
        st.handle(decode_register(d, t, k))
    return st


def snapshot(st: BootstrapState) -> dict[str, Any]:
    """Everything a message could change (the clock excluded)."""
    return copy.deepcopy({k: v for k, v in vars(st).items() if k != "_clock"})

"""Builders shared by the protocol unit tests: a fake clock, codecs, registrations and messages."""

from __future__ import annotations

import copy
from typing import Any

from pdfleet_runtime.layouts import PRESETS
from pdfleet_runtime.protocol.auth import Codec
from pdfleet_runtime.protocol.bootstrap import BootstrapState
from pdfleet_runtime.protocol.virtual import decode_register, engine_info, prefill_register, transfer_request
from pdfleet_runtime.records import ParallelShape

__all__ = ["LAYOUT", "RANK_KEY", "SECRET", "FakeClock", "codec", "decode_register", "engine_info",
           "prefill_register", "ready_state", "snapshot", "transfer_request"]

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

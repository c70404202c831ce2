"""What a multi-process parity group runs: its cases, shapes, backend, timing and GPU placement (pure, pickled)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from pdfleet_runtime.links import LinkProtocol
from pdfleet_runtime.records import ParallelShape

__all__ = ["CaseSpec", "GroupSpec", "gpu_of"]


@dataclass(frozen=True)
class CaseSpec:
    """One parity case (a layout) of a group; requests share ``tokens`` as in ``verify.parity.run_parity``."""

    layout_name: str
    requests: int = 2
    tokens: int = 96
    seed: int = 7

    @property
    def name(self) -> str:
        return f"{self.layout_name}-s{self.seed}"


@dataclass(frozen=True)
class GroupSpec:
    """Everything a rank process needs (pickled to spawned processes)."""

    backend: str
    prefill: ParallelShape
    decode: ParallelShape
    cases: tuple[CaseSpec, ...]
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)
    rank_key: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)
    """The bootstrap's rank key, shared with the group's prefill rank processes (``protocol.keys``)."""
    request_timeout_s: float = 60.0
    lease_s: float = 5.0
    write_timeout_s: float = 30.0
    device: str = "cpu"
    """``cpu``, or ``cuda``: each rank's pools on one GPU of the host (``gpu_of``)."""
    protocol: LinkProtocol = LinkProtocol.TCP
    engine_env: dict[str, str | None] = field(default_factory=dict)
    """Overrides of the protocol table's engine environment (``EngineConfig.env``)."""
    placement: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
    """Explicit GPU per global rank (prefill, decode); empty means ``gpu_of``'s default spread."""


def gpu_of(spec: GroupSpec, side: int, rank: int, count: int) -> int:
    """The GPU of a rank (``side`` 1 prefill, 2 decode): the explicit placement, else prefill rank r on
    GPU ``r % count`` and decode rank r on GPU ``(r + 1) % count``, so that with two GPUs an equal-TP
    pair always crosses GPUs and a 2 -> 1 aggregation has one leg within a GPU and one across."""
    explicit = spec.placement[side - 1]
    if explicit:
        return explicit[rank] % count
    return (rank + (side - 1)) % count

"""What a parity run is asked and what it answers: its configuration, a rejection, the result with its fields."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdfleet_runtime.layouts import Layout
from pdfleet_runtime.protocol.states import RequestState
from pdfleet_runtime.rank.pipe import ArenaCheck, Mismatch, RankStats, TransferResult
from pdfleet_runtime.records import ParallelShape

__all__ = ["DecodeRun", "ParityConfig", "ParityResult", "PrefillRun", "Rejection", "RunDetails"]


@dataclass(frozen=True)
class ParityConfig:
    layout: Layout
    prefill: ParallelShape
    decode: ParallelShape
    requests: int = 8
    tokens: int = 4096
    seed: int = 7
    backend: str = "local"
    layout_name: str = "inline"
    device: str = "cpu"
    protocol: str = "tcp"
    """The engine backends' ``spec.transfer.protocol`` (``tcp`` on host memory, ``nvlink`` on GPUs)."""


@dataclass(frozen=True)
class Rejection:
    """The matrix said no: the rule id, the message and the reason."""

    rule: str
    message: str
    reason: str


@dataclass(frozen=True)
class DecodeRun:
    """What one decode rank answered: each request's result (with its sources' reports), the arena check, stats."""

    results: tuple[TransferResult, ...]
    check: ArenaCheck
    stats: RankStats


@dataclass(frozen=True)
class PrefillRun:
    """One prefill rank's side of a case: requests given back, free counts before and after, leg outcomes."""

    requests: int
    released: int
    free_before: dict[str, int]
    free_after: dict[str, int]
    states: dict[str, RequestState]
    """Per request, over the pod's legs (failed if one leg failed)."""
    failures: dict[str, str]
    """Per failed request, the reason of a failed leg."""


@dataclass(frozen=True)
class RunDetails:
    """What the serving rank processes of a multi-process run reported (``group.run_case``)."""

    decode: list[DecodeRun]
    prefill: list[PrefillRun]
    devices: dict[str, str]
    """Each rank process's torch device, by rank name."""


@dataclass
class ParityResult:
    ok: bool
    bytes_moved: int = 0
    descriptors: int = 0
    mismatched_bytes: int = 0
    bytes_by_state: dict[str, int] = field(default_factory=dict)
    descriptors_by_state: dict[str, int] = field(default_factory=dict)
    request_tokens: list[int] = field(default_factory=list)
    first_mismatch: Mismatch | None = None
    rejection: Rejection | None = None
    plan_seconds: float = 0.0
    copy_seconds: float = 0.0
    details: RunDetails | None = None
    """Multi-process runs only (None in process, and for a case rejected before any process started)."""

    def as_json(self, cfg: ParityConfig) -> dict[str, object]:
        return {
            "ok": self.ok,
            "layout": cfg.layout_name,
            "prefill": str(cfg.prefill),
            "decode": str(cfg.decode),
            "backend": cfg.backend,
            "device": cfg.device,
            "protocol": cfg.protocol,
            "bytes_moved": self.bytes_moved,
            "descriptors": self.descriptors,
            "mismatched_bytes": self.mismatched_bytes,
            "bytes_by_state": self.bytes_by_state,
            "descriptors_by_state": self.descriptors_by_state,
            "request_tokens": self.request_tokens,
            "first_mismatch": self.first_mismatch.describe() if self.first_mismatch else None,
            "rejected": None if self.rejection is None else {
                "rule": self.rejection.rule, "message": self.rejection.message, "reason": self.rejection.reason},
            "plan_seconds": round(self.plan_seconds, 6),
            "copy_seconds": round(self.copy_seconds, 6),
        }

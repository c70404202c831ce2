"""Per-chunk timelines of a staged leg: host stamps kept per request, one log line per request and side.

Why: a staged request's time is spent in a handful of steps per chunk (gather, post, the link's
write, the landed signal, the decode's scatter) plus fixed costs before the first chunk and after the
last; only a timeline shows which dominate. ``staging.send`` and ``staging.receive`` already append
``(chunk, step, perf_counter)`` to a list when given one (a tuple per step: cheap); this module turns
that list into one ``Timeline`` per request and side (``time.monotonic()`` seconds, the clock the
pods' other log lines use), logged once when the leg ends, never per chunk. Pure: no torch, no engine.

Steps per chunk. Sender: ``gather`` (queued on the side stream), ``post`` (the gather seen ended, the
write posted), ``posted`` (the post call returned), ``write`` and ``written`` (Mooncake only: the
poster thread's blocking write started and returned, ``engines/chunks.py``), ``done`` (the write seen
done), ``landed`` (the landed word written). Receiver: ``scatter`` (the landed count seen, the scatter queued), ``freed`` (the
scatter seen ended, the slot freed). Marks: ``start`` and ``end`` of the leg on both sides; the
receiver's ``table`` (the source's ready word seen) and ``plan`` (its scatter plan cut).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RECEIVE_STEPS", "SEND_STEPS", "Timeline", "parse"]

SEND_STEPS = ("gather", "post", "posted", "write", "written", "done", "landed")
RECEIVE_STEPS = ("scatter", "freed")
_LINE = re.compile(r"staged timeline (send|receive) (\S+): (\{.*\})\s*$", re.M)


@dataclass
class Timeline:
    """One side of one staged leg: marks and per-chunk stamps, seconds since ``start`` (monotonic)."""

    side: str
    request: str
    start: float
    where: str = ""
    marks: dict[str, float] = field(default_factory=dict)
    chunks: dict[str, list[float | None]] = field(default_factory=dict)

    @classmethod
    def begin(cls, side: str, request: str, where: str = "") -> Timeline:
        return cls(side, request, time.monotonic(), where, {"start": 0.0})

    def mark(self, name: str) -> None:
        self.marks[name] = time.monotonic() - self.start

    def add_trace(self, trace: list[tuple[int, str, float]]) -> None:
        """Fold ``staging``'s ``(chunk, step, perf_counter)`` list in (converted to monotonic seconds)."""
        offset = time.monotonic() - time.perf_counter() - self.start
        steps = SEND_STEPS if self.side == "send" else RECEIVE_STEPS
        n = 1 + max((k for k, _, _ in trace), default=-1)
        self.chunks = {s: [None] * n for s in steps}
        for k, step, t in trace:
            if step in self.chunks:
                self.chunks[step][k] = t + offset

    @property
    def n_chunks(self) -> int:
        return max((len(v) for v in self.chunks.values()), default=0)

    def at(self, step: str, k: int) -> float | None:
        """Monotonic time of chunk ``k``'s ``step`` (None when not reached)."""
        v = self.chunks.get(step, [])
        t = v[k] if k < len(v) else None
        return None if t is None else self.start + t

    def to_dict(self) -> dict[str, Any]:
        def us(x: float | None) -> float | None:
            return None if x is None else round(x * 1e6, 1)

        return {"start": round(self.start, 6), "where": self.where,
                "marks_us": {k: us(v) for k, v in self.marks.items()},
                "chunks_us": {k: [us(x) for x in v] for k, v in self.chunks.items()}}

    def line(self) -> str:
        """The one log line of this leg (``parse`` reads it back)."""
        return f"staged timeline {self.side} {self.request}: {json.dumps(self.to_dict(), separators=(',', ':'))}"

    @classmethod
    def from_dict(cls, side: str, request: str, d: dict[str, Any]) -> Timeline:
        def s(x: float | None) -> float | None:
            return None if x is None else x / 1e6

        return cls(side, request, float(d["start"]), d.get("where", ""),
                   {k: v / 1e6 for k, v in d["marks_us"].items()},  # marks are always stamped (to_dict)
                   {k: [s(x) for x in v] for k, v in d["chunks_us"].items()})


def parse(log: str) -> list[Timeline]:
    """Every timeline line in a pod's log, in order."""
    return [Timeline.from_dict(m.group(1), m.group(2), json.loads(m.group(3))) for m in _LINE.finditer(log)]

"""Issue 39: a rank's held items are accounted by why and reconciled against its running requests, and pools
with no room while nothing runs are not Ready. Real pools and allocator (CPU), an injected clock."""

from __future__ import annotations

from pdfleet_runtime.layouts import PRESETS
from pdfleet_runtime.pod.readiness import Problem, Readiness, pools_held
from pdfleet_runtime.pools import Capacity, RankPools, RequestAllocator
from pdfleet_runtime.rank.requests import SyntheticSource
from pdfleet_runtime.records import ParallelShape

LAYOUT = PRESETS["llama-dense"]


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _source(clock: Clock, holding: set[str]) -> SyntheticSource:
    cap = Capacity(4, 256)
    src = SyntheticSource(RankPools(LAYOUT, ParallelShape(1), 0, 0, cap), RequestAllocator(LAYOUT, cap),
                          orphan_grace_s=30.0, clock=clock)
    src.holding = lambda: set(holding)
    return src


def test_orphans_are_given_back_after_the_grace_and_running_requests_never() -> None:
    clock, holding = Clock(), {"a", "b"}
    src = _source(clock, holding)
    full = src.free()
    for rid in ("a", "b", "c"):
        src.take(rid, 16)
    assert src.held_by() == {"running": 2, "fencing": 0, "orphaned": 1}
    assert src.reconcile() == []  # first seen orphaned now
    clock.t += 29.0
    assert src.reconcile() == [] and "c" in src.held  # not before the grace
    holding.discard("b")  # its coordinator dropped it without a release: an orphan from now
    clock.t += 1.5
    assert src.reconcile() == ["c"] and src.reclaimed == 1
    assert src.held_by() == {"running": 1, "fencing": 0, "orphaned": 1}
    clock.t += 30.0
    assert src.reconcile() == ["b"] and src.reclaimed == 2
    src.release("a")
    assert src.held == {} and src.free() == full  # every item back


def test_an_id_already_held_is_refused_before_anything_is_allocated() -> None:
    src = _source(Clock(), {"a"})
    src.take("a", 16)
    free = src.free()
    try:
        src.take("a", 16)
        raise AssertionError("taken twice")
    except ValueError as e:
        assert "already holds items" in str(e)
    assert src.free() == free and len(src.held) == 1


def test_pools_full_with_nothing_running_is_not_ready() -> None:
    need = {"page": 4, "slot": 1, "row": 1}
    full = [{"page": 100, "slot": 0, "row": 0}]
    assert pools_held([{"running": 0, "fencing": 0, "orphaned": 8}], full, need, active=0).startswith(
        "pools full with no request running: no free row, slot")
    assert pools_held([{"running": 8}], full, need, active=0) == ""  # full of work: load, not a problem
    assert pools_held([{"orphaned": 8}], full, need, active=2) == ""  # requests admitted: they hold them
    assert pools_held([{"orphaned": 1}], [{"page": 100, "slot": 3, "row": 3}], need, active=0) == ""  # room left
    r = Readiness("decode", floor_gbps=0.0, clock=lambda: 0.0, ranks_total=1, ranks_up=1)
    from pdfleet_runtime.pod.readiness import CanaryResult

    r.record_canary("p:1", CanaryResult(True, bytes=10, write_s=1.0))
    assert r.verdict().ready
    r.pools_held = pools_held([{"fencing": 2, "orphaned": 6}], full, need, active=0)
    v = r.verdict()
    assert not v.ready and v.problem is Problem.POOLS_HELD and "2 requests held while their writes are fenced" in v.reason
    r.pools_held = ""
    assert r.verdict().ready

"""Replica groups as units (pure): a replica of nodesPerReplica N is N pods, planned as one.

A group is the pods of one (role, revision, index), its size written on each pod (the identity's
``/member/nodes``; a single-node pod is a group of one, unchanged). The planner, the rollout
bookkeeping and the status see each group as one unit: an ``ObservedPod`` with the leader's name,
drain and gate, ready only when every member is, unscheduled while any member is, gated (Kueue's gang
not yet admitted) while any member is.

A group is broken when a member is missing or going (deleted, evicted, failed) while others live, or
when its leader reports it lost a member (``Problem.GROUP_MEMBER_LOST``: the replica-group contract: the
group's failure, answered by a restart, not a failure of the revision it runs): a half group holds GPUs and serves
nothing, so it is restarted as a unit: its live members are deleted and the unit counts as
terminating (it still holds GPUs within the surge room); the step planner then creates the replica
again under a fresh index, as it does for any replica that went.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from pdfleet_operator.observed import ObservedPod
from pdfleet_runtime.readiness_problems import Problem

__all__ = ["Group", "PlacementWait", "groups_of", "placement_wait", "units"]


@dataclass(frozen=True)
class Group:
    unit: ObservedPod  # the group as one replica
    members: tuple[ObservedPod, ...]  # by member number; a missing member is absent
    broken: str | None = None  # why it restarts as a unit (its live members are deleted)

    @property
    def live(self) -> tuple[ObservedPod, ...]:
        return tuple(m for m in self.members if not m.deleting)


def _broken(members: list[ObservedPod], size: int) -> str | None:
    live = [m for m in members if not m.deleting]
    if not live:
        return None  # terminating as a whole
    present = {m.member for m in live}
    gone = [str(m) for m in range(size) if m not in present]
    if gone:
        return f"member {', '.join(gone)} of {size} missing or deleted"
    failed = [m.name for m in live if m.failed]
    if failed:
        return f"pod {', '.join(failed)} failed"
    leader = next(m for m in live if m.member == 0)
    if leader.gate == "False" and leader.gate_problem is Problem.GROUP_MEMBER_LOST:
        return f"leader {leader.name} lost a member ({leader.gate_message})"
    return None


def _group(members: list[ObservedPod]) -> Group:
    members.sort(key=lambda m: (m.member, m.name))
    size = max(m.group_size for m in members)
    if size == 1 and len(members) == 1:
        return Group(members[0], (members[0],))
    broken = _broken(members, size)
    live = [m for m in members if not m.deleting]
    base = next((m for m in members if m.member == 0), members[0])
    unit = replace(
        base,
        ready=broken is None and len(live) == size and all(m.ready for m in live),
        deleting=not live or broken is not None,
        scheduled=all(m.scheduled for m in live) if live else base.scheduled,
        gates=tuple(sorted({g for m in live for g in m.gates})),
        restarts=max(m.restarts for m in members),
    )
    return Group(unit, tuple(members), broken)


def groups_of(pods: Iterable[ObservedPod]) -> list[Group]:
    """The pods by group (role, revision, index), sorted by the unit's name."""
    by_key: dict[tuple, list[ObservedPod]] = {}
    for p in pods:
        by_key.setdefault((p.role, p.revision, p.index), []).append(p)
    return sorted((_group(ms) for ms in by_key.values()), key=lambda g: g.unit.name)


def units(pods: Iterable[ObservedPod]) -> list[ObservedPod]:
    """Each group as one unit (single-node pods as they are)."""
    return [g.unit for g in groups_of(pods)]


@dataclass(frozen=True)
class PlacementWait:
    """Groups of one revision not yet placed: ``gated`` wait whole for Kueue (its scheduling gate on a
    member: no member holds a GPU), ``partial`` have some members on nodes and others pending (no gang
    scheduler: the placed members hold GPUs while the group serves nothing)."""

    gated: tuple[Group, ...] = ()
    partial: tuple[Group, ...] = ()


def placement_wait(pods: Iterable[ObservedPod], revision: str) -> PlacementWait:
    """Which live, unbroken groups of ``revision`` wait to be placed, and how."""
    gated, partial = [], []
    for g in groups_of(p for p in pods if p.revision == revision):
        if g.broken or g.unit.deleting or g.unit.drain_started is not None:
            continue
        if g.unit.gates:
            gated.append(g)
        elif not g.unit.scheduled and any(m.scheduled for m in g.live):
            partial.append(g)
    return PlacementWait(tuple(gated), tuple(partial))

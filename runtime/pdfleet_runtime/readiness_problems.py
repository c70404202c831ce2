"""Why a pod is not ready: the transfer-path gate's reasons, one vocabulary for the runtime and the operator.

The runtime (``pod.readiness``) names every verdict with a ``Problem``, written as the reason of the
pod's ``pdfleet.io/transfer-path`` condition (CamelCase, as Kubernetes wants it). The operator reads the
reason back (``gate_problem``) and fails a rollout on the reasons in ``GATE_FAILURES``: the pod's path is
broken. Every other reason (Starting, WaitingForCanary, NoPeerFound, ...) means "not yet" and only counts
against the gate timeout. Pure (no import), so the operator imports it.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["GATE_FAILURES", "PATH_BROKEN", "Problem", "gate_problem"]


class Problem(StrEnum):
    """Why a pod is not ready (the gate condition's ``reason``)."""

    NONE = "TransferPathVerified"
    STARTING = "Starting"
    RANK_DIED = "RankProcessDied"
    DRAINING = "Draining"
    NO_PEER = "NoPeerFound"
    UNREACHABLE = "PeerUnreachable"
    INCOMPATIBLE = "PeerIncompatible"
    SLOW = "BelowThroughputFloor"
    CORRUPT = "BytesMismatched"
    FAILING = "TransfersFailing"
    PEER_DRAINING = "PeerDraining"
    WAITING = "WaitingForCanary"
    WAITING_FOR_GROUP = "WaitingForGroup"
    """A replica group's members have not all joined with their ranks up (``nodesPerReplica`` > 1)."""
    GROUP_MEMBER_LOST = "GroupMemberLost"
    """A member of this replica's group went away: the group serves nothing until it restarts as a unit
    (the operator restarts the group; it is not a failure of the revision the group runs)."""
    POOLS_HELD = "PoolsHeld"
    """A rank's pools have no room for a request while no request runs on the pod: held items that nothing
    will give back soon (failed requests fencing, or orphans until the rank's reconcile frees them)."""


GATE_FAILURES: frozenset[Problem] = frozenset({
    Problem.RANK_DIED, Problem.INCOMPATIBLE, Problem.SLOW, Problem.CORRUPT, Problem.FAILING,
    Problem.GROUP_MEMBER_LOST,
})
"""Reasons of a False gate that mean the pod's path is broken (not "not yet")."""


PATH_BROKEN: frozenset[Problem] = GATE_FAILURES | {Problem.UNREACHABLE, Problem.POOLS_HELD}
"""Reasons of a False gate the PDDeployment reports as ``Degraded`` (``TransferPathBroken``): the pod's path is broken
now. A rollout fails only on ``GATE_FAILURES``; an unreachable peer or held pools count once the pod ran a while
(the operator's ``status.BROKEN_AFTER_S``): a prefill still starting is unreachable too."""


def gate_problem(reason: str | None) -> Problem | None:
    """The problem a gate condition's ``reason`` names; None for none, or for a reason the built-in runtime
    does not give (the SGLang agent's own, ``agent.readiness.AgentProblem``: never a gate failure)."""
    try:
        return Problem(reason) if reason else None
    except ValueError:
        return None

"""A pod whose transfer path is broken makes the PDDeployment ``Degraded`` (``TransferPathBroken``), naming the pod,
its role and its gate's reason (pure: ``status.with_transfer_health``); so does a pod counting silent fallbacks
(``SilentFallback``, ``status.with_silent_fallbacks``)."""

from __future__ import annotations

from pdfleet_operator.api.constants import ConditionStatus, ConditionType, Role
from pdfleet_operator.conditions import condition
from pdfleet_operator.observed import Generation, ObservedPod, RouterState
from pdfleet_operator.status import (
    BROKEN_AFTER_S,
    GENERATIONS_MIXED,
    SILENT_FALLBACK,
    TRANSFER_PATH_BROKEN,
    broken_wake,
    with_mixed_generations,
    with_silent_fallbacks,
    with_transfer_health,
)
from pdfleet_runtime.readiness_problems import Problem

NOW = 1_000_000.0
CLEAR = [condition(ConditionType.ADMITTED, True, "MatrixAdmits", "admitted", 1),
         condition(ConditionType.DEGRADED, False, "MatrixAdmits", "matrix admits the spec", 1)]


def pod(name: str, role: Role = Role.DECODE, *, problem: Problem | None = None, ran_s: float = 600.0,
        **kw: object) -> ObservedPod:
    gate = "True" if problem is None else "False"
    message = f"{problem.value}: prefill pod 10.0.0.1:8998: it happened" if problem is not None else ""
    return ObservedPod(name, role, "rev", 0, problem is None, gate=gate, gate_problem=problem, gate_message=message,
                       running_since=NOW - ran_s, **kw)  # type: ignore[arg-type]


def degraded(conditions: list) -> tuple[ConditionStatus, str | None, str | None]:
    [c] = [c for c in conditions if c.type is ConditionType.DEGRADED]
    return c.status, c.reason, c.message


def test_healthy_pods_leave_degraded_as_admission_wrote_it() -> None:
    assert with_transfer_health(CLEAR, [pod("d-0"), pod("p-0", Role.PREFILL)], NOW, 1) == CLEAR


def test_a_broken_pod_is_named_with_its_role_and_its_gates_reason() -> None:
    pods = [pod("p-0", Role.PREFILL), pod("d-1", problem=Problem.CORRUPT), pod("d-0", problem=Problem.UNREACHABLE)]
    status, reason, message = degraded(with_transfer_health(CLEAR, pods, NOW, 1))
    assert (status, reason) == (ConditionStatus.TRUE, TRANSFER_PATH_BROKEN)
    assert message == ("transfer path broken: decode pod d-0: PeerUnreachable: prefill pod 10.0.0.1:8998: it happened; "
                       "decode pod d-1: BytesMismatched: prefill pod 10.0.0.1:8998: it happened")


def test_not_yet_reasons_draining_and_deleted_pods_are_no_broken_path() -> None:
    pods = [pod("d-0", problem=Problem.WAITING), pod("d-1", problem=Problem.STARTING),
            pod("d-2", problem=Problem.CORRUPT, drain_started=NOW - 5), pod("d-3", problem=Problem.CORRUPT, deleting=True),
            pod("d-4", problem=Problem.PEER_DRAINING), pod("d-5", problem=Problem.NO_PEER)]
    assert with_transfer_health(CLEAR, pods, NOW, 1) == CLEAR


def test_an_unreachable_peer_counts_once_the_pod_ran_a_while_and_a_pass_is_due_then() -> None:
    young = pod("d-0", problem=Problem.UNREACHABLE, ran_s=10.0)  # its prefill may still be starting
    assert with_transfer_health(CLEAR, [young], NOW, 1) == CLEAR
    wake = broken_wake([young], NOW)
    assert wake is not None and abs(wake - (BROKEN_AFTER_S - 10.0)) < 0.1
    assert degraded(with_transfer_health(CLEAR, [young], NOW + wake, 1))[0] is ConditionStatus.TRUE
    assert broken_wake([young], NOW + wake) is None
    # a failure reason (bytes that differ) counts at once
    assert degraded(with_transfer_health(CLEAR, [pod("d-1", problem=Problem.CORRUPT, ran_s=1.0)], NOW, 1))[0] \
        is ConditionStatus.TRUE


def test_an_earlier_degraded_reason_holds_and_gains_the_pods() -> None:
    failed = [CLEAR[0], condition(ConditionType.DEGRADED, True, "RolloutFailed", "decode: rolled back", 1)]
    status, reason, message = degraded(with_transfer_health(failed, [pod("d-1", problem=Problem.CORRUPT)], NOW, 1))
    assert (status, reason) == (ConditionStatus.TRUE, "RolloutFailed")
    assert message is not None and message.startswith("decode: rolled back\ntransfer path broken: decode pod d-1: ")


def test_pods_counting_silent_fallbacks_make_it_degraded_named_with_their_counts() -> None:
    said = "NoStateReceived: silent fallbacks in the last 120 s (no_state_received: ...)"
    pods = [pod("p-0", Role.PREFILL, fallback="UnclaimedState: state expired"), pod("d-0", fallback=said),
            pod("d-1"), pod("d-2", fallback=said, deleting=True)]
    status, reason, message = degraded(with_silent_fallbacks(CLEAR, pods, 1))
    assert (status, reason) == (ConditionStatus.TRUE, SILENT_FALLBACK)
    assert message == f"silent fallback: decode pod d-0: {said}; prefill pod p-0: UnclaimedState: state expired"
    assert with_silent_fallbacks(CLEAR, [pod("d-1"), pod("p-0", Role.PREFILL)], 1) == CLEAR
    # an earlier Degraded reason keeps its place and gains the line
    both = with_silent_fallbacks(with_transfer_health(CLEAR, [pod("d-3", problem=Problem.CORRUPT)], NOW, 1), pods, 1)
    status, reason, message = degraded(both)
    assert reason == TRANSFER_PATH_BROKEN and message is not None and "\nsilent fallback: decode pod d-0" in message


def test_a_router_that_can_pair_two_generations_makes_it_degraded() -> None:
    pods = [pod("p-0", Role.PREFILL, compat="k1"), pod("d-0", compat="k1"), pod("d-1", compat="k2"),
            pod("p-1", Role.PREFILL, compat="k2", drain_started=NOW)]  # a draining pod is not paired
    by_generation = RouterState(Generation("k1", "k1"), settled=False)
    assert with_mixed_generations(CLEAR, pods, by_generation, 1) == CLEAR  # d-1 waits for the switch
    for router in (RouterState(None, settled=True), None):  # selectors without a generation, or no router read
        status, reason, message = degraded(with_mixed_generations(CLEAR, pods, router, 1))
        assert (status, reason) == (ConditionStatus.TRUE, GENERATIONS_MIXED)
        assert message == "generations mixed: the router pairs decode pods of 2 keys (k1: d-0; k2: d-1)"

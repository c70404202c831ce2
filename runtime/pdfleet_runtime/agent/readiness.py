"""The agent's verdict on its pod (pure; the agent feeds it facts): ready, and if not, why not.

In order, the first that holds decides: draining; the engine not answering ``/health`` (still starting,
or down after it was up); ``/server_info`` contradicting the deployment (version, served model, role);
the model's ``config.json`` contradicting the layout; then, decode pods only, the canary: ready once a
canary through some prefill pod passed, until ``failures_not_ready`` canaries in a row fail. A prefill
pod is ready once its engine passed the checks (the decode pods' canaries prove its path). A member of a
replica group (node rank >= 1) is ready once its engine answers ``/health``: its ranks serve through the
leader, whose checks and canary prove the replica. The reason is the readiness gate condition's
``reason``, CamelCase as Kubernetes wants it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

__all__ = ["AgentProblem", "AgentReadiness", "AgentVerdict"]


class AgentProblem(StrEnum):
    NONE = "TransferPathVerified"
    ENGINE_VERIFIED = "EngineVerified"
    GROUP_MEMBER = "GroupMemberUp"
    DRAINING = "Draining"
    STARTING = "EngineStarting"
    ENGINE_DOWN = "EngineUnhealthy"
    ENGINE_MISMATCH = "EngineMismatch"
    MODEL_CONFIG = "ModelConfigMismatch"
    NO_PEER = "NoPeerFound"
    UNREACHABLE = "PeerUnreachable"
    CANARY_FAILED = "CanaryFailed"
    WAITING = "WaitingForCanary"


@dataclass(frozen=True)
class AgentVerdict:
    ready: bool
    problem: AgentProblem
    reason: str


@dataclass
class AgentReadiness:
    role: str
    failures_not_ready: int = 3
    group_member: int = 0  # node rank in the replica group; > 0: the engine serves /health only
    router: str = "SGLang's router"
    """Whose requests the canary imitates (the reason names it)."""
    draining: bool = False
    engine_up: bool = False
    engine_was_up: bool = False
    engine_error: str = "no answer from the engine's /health yet"
    engine_problems: list[str] = field(default_factory=list)
    config_problems: list[str] = field(default_factory=list)
    discovery_error: str = ""
    canary_ok: str = ""
    """The last passing canary's sentence; empty when none passed since the last run of failures."""
    canary_failures: int = 0
    last_failure: str = ""
    last_failure_unreachable: bool = False

    def engine_health(self, up: bool, error: str = "") -> None:
        self.engine_up = up
        self.engine_was_up |= up
        self.engine_error = error

    def canary(self, ok: bool, reason: str, unreachable: bool = False) -> None:
        if ok:
            self.canary_ok, self.canary_failures, self.discovery_error = reason, 0, ""
        else:
            self.canary_failures += 1
            self.last_failure, self.last_failure_unreachable = reason, unreachable
            if self.canary_failures >= self.failures_not_ready:
                self.canary_ok = ""

    @property
    def checked(self) -> bool:
        """The engine is up and agrees with the deployment (the canary may run)."""
        return self.engine_up and not self.engine_problems and not self.config_problems

    def verdict(self) -> AgentVerdict:
        P = AgentProblem
        if self.draining:
            return AgentVerdict(False, P.DRAINING, "the pod is draining: routers drop it, then the engine finishes "
                                "its running and queued requests")
        if not self.engine_up:
            return AgentVerdict(False, P.ENGINE_DOWN if self.engine_was_up else P.STARTING, self.engine_error)
        if self.engine_problems:
            return AgentVerdict(False, P.ENGINE_MISMATCH, "; ".join(self.engine_problems))
        if self.config_problems:
            return AgentVerdict(False, P.MODEL_CONFIG, "; ".join(self.config_problems))
        if self.group_member:
            return AgentVerdict(True, P.GROUP_MEMBER, f"node rank {self.group_member}'s engine answers /health "
                                "(the group's leader serves and its checks prove the replica)")
        if self.role != "decode":
            return AgentVerdict(True, P.ENGINE_VERIFIED, "the engine answers and agrees with the deployment (its "
                                "transfer path is proven by the decode pods' canaries)")
        if self.canary_ok:
            return AgentVerdict(True, P.NONE, f"canary as {self.router} sends it: {self.canary_ok}")
        if self.canary_failures:
            problem = P.UNREACHABLE if self.last_failure_unreachable else P.CANARY_FAILED
            return AgentVerdict(False, problem, f"{self.canary_failures} canaries failed in a row, the last: "
                                f"{self.last_failure}")
        if self.discovery_error:
            return AgentVerdict(False, P.NO_PEER, self.discovery_error)
        return AgentVerdict(False, P.WAITING, "no canary has run yet")

    def as_json(self) -> dict[str, Any]:
        v = self.verdict()
        return {"ready": v.ready, "problem": v.problem.value, "reason": v.reason, "role": self.role,
                "engineUp": self.engine_up, "engineProblems": self.engine_problems,
                "configProblems": self.config_problems, "canaryFailures": self.canary_failures,
                "draining": self.draining}

"""What observe saw, as the pure planners read it: the owner, each pod, the snapshot of one pass.

``observe`` builds these from the watched objects (reads only); ``plan``, ``groups``, ``rollout_state``
and ``status`` read them. They import nothing of the operator's but its API names, so every planner
imports them from below.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pdfleet_operator.api.constants import API_VERSION, KIND, Role
from pdfleet_operator.api.models import PDDeploymentSpec
from pdfleet_runtime.readiness_problems import Problem

__all__ = ["Generation", "ObservedPod", "Owner", "RouterState", "Snapshot"]


@dataclass(frozen=True)
class Owner:
    """The PDDeployment that owns the children."""

    name: str
    namespace: str
    uid: str

    def reference(self) -> dict:
        return {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


@dataclass(frozen=True)
class ObservedPod:
    """One owned pod (its identity from the annotation, its state from the pod's labels and status)."""

    name: str
    role: Role
    revision: str
    index: int
    ready: bool
    deleting: bool = False
    labels_ok: bool = True  # False when a user edited the identity labels away
    drain_started: float | None = None  # epoch seconds of the drain annotation; None: not draining
    drain_cancelled: float | None = None  # epoch seconds of the last drain cancel (annotation)
    drained: bool = False  # the runtime set the pdfleet.io/drained condition True
    gate: str | None = None  # the transfer-path condition's status: "True", "False" or None (unknown)
    gate_problem: Problem | None = None  # the condition's reason: the runtime's readiness problem (None: none)
    gate_message: str = ""  # its reason and message, for a failed gate
    fallback: str = ""  # the pdfleet.io/silent-fallback condition's reason and message while True ("": none)
    restarts: int = 0  # container restarts, summed
    running_since: float | None = None  # epoch seconds the pod started running; None: not running
    compat: str = ""  # the pdfleet.io/compat label
    scheduled: bool = True  # spec.nodeName is set (False: stuck Pending, no container ever ran)
    member: int = 0  # its place in its replica group (0: the leader; every single-node pod is one)
    group_size: int = 1  # the pods of its group (nodesPerReplica of the revision it was made from)
    failed: bool = False  # phase Failed (evicted, or its containers ended and will not restart)
    ip: str | None = None  # status.podIP (the autoscaler reads its metrics there)
    created: float | None = None  # epoch seconds of metadata.creationTimestamp
    ready_since: float | None = None  # epoch seconds the Ready condition last became True (None: not ready)
    gates: tuple[str, ...] = ()  # Kueue's scheduling gates still on it: its gang waits for admission
    gang: str = ""  # its Kueue pod group (the kueue.x-k8s.io/pod-group-name label); "": not a Kueue gang


@dataclass(frozen=True)
class Generation:
    """The compatibility keys (``resources.compat``) of the prefill and decode pods a router pairs."""

    prefill: str
    decode: str

    def of(self, role: Role) -> str:
        return self.prefill if role is Role.PREFILL else self.decode


@dataclass(frozen=True)
class RouterState:
    """The router Deployment as observed (``generations``)."""

    serving: Generation | None  # the generation its selectors carry (annotations); None: not recorded
    settled: bool  # its current template is rolled out: every router pod is of it, and available


@dataclass(frozen=True)
class Snapshot:
    """What observe saw: owned pods, whether the auth and router secrets exist, and the stored revisions
    (``(role, revision) -> spec`` from the deployment's ControllerRevisions)."""

    pods: tuple[ObservedPod, ...] = ()
    secret_exists: bool = False
    revisions: Mapping[tuple[Role, str], PDDeploymentSpec] = field(default_factory=dict)
    router_secret_exists: bool = False
    worker_secret_exists: bool = False
    group_secrets: frozenset[Role] = frozenset()  # roles whose group key Secret exists (read for grouped roles only)
    router: RouterState | None = None  # the router Deployment; None: there is none

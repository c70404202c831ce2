"""The contracts of an engine kind and a router kind as the operator renders them.

An engine kind (``EnginePlugin``) says what its pods need beyond the runtime pod: its rules (versions,
owned flags, the check harness: ``pdfleet_runtime.engine_rules``' ``EngineRules``), its worker as a router
sees it (``WorkerContract``: the port and health path), the rendezvous port of a replica group, and, for an
engine running beside the pdfleet agent, its container (``EngineContainer``: command, environment, the
prefill's bootstrap port and the annotation naming it). A router kind (``RouterPlugin``) renders its
containers, volumes and the Secret it needs from ``RouterDiscovery`` (what it discovers and how it checks
workers). Implementations live beside this module and are found by kind in ``registry``; generic
rendering (``pods``, ``engine``, ``router``, ``plan``) calls them and never names an engine or a router.
"""

from __future__ import annotations

from typing import Protocol

from pydantic import BaseModel, ConfigDict

from pdfleet_operator.api.constants import Role
from pdfleet_operator.api.models import EngineKind, PDDeploymentSpec, RouterKind
from pdfleet_runtime.engine_rules import EngineRules

__all__ = [
    "ROUTER_CONTAINER",
    "EngineContainer",
    "EnginePlugin",
    "GroupMember",
    "NamedPort",
    "RouterDiscovery",
    "RouterPlugin",
    "WorkerContract",
]

ROUTER_CONTAINER = "router"  # the container running the router (on the pod's loopback, behind the front)


class _Seam(BaseModel):
    model_config = ConfigDict(frozen=True)


class NamedPort(_Seam):
    name: str
    port: int


class WorkerContract(_Seam):
    """A worker as the router reaches it: requests and health checks on ``port``, health at ``health_path``
    (the engine container's probes use the same path)."""

    port: int
    health_path: str


class GroupMember(_Seam):
    """One pod of a multi-node replica group as its engine sees it: its node rank and the group's first pod,
    by the DNS name of the group's headless Service (each engine adds its own rendezvous port)."""

    node_rank: int
    leader_host: str


class RouterDiscovery(_Seam):
    """What a router discovers and how it checks its workers: the namespace's pods matching each role's
    selector (``key=value`` terms), reached on ``worker_port``; a worker failing ``health_failures`` checks
    ``health_interval_s`` apart (each with ``health_timeout_s``) gets no new requests; a worker whose first
    probe fails is probed again after ``startup_check_s``."""

    namespace: str
    worker_port: int
    prefill_selector: tuple[str, ...]
    decode_selector: tuple[str, ...]
    health_interval_s: int
    health_failures: int
    health_timeout_s: int
    startup_check_s: int


class EngineContainer(Protocol):
    """An engine run in its own container beside the pdfleet agent (``resources.engine.with_engine``)."""

    @property
    def bootstrap_annotation(self) -> str:
        """The prefill leader's annotation naming its bootstrap port (the engine's router reads it)."""
        ...

    def command(self, name: str, spec: PDDeploymentSpec, role: Role, member: GroupMember | None) -> list[str]:
        """The engine's command line: owned flags from the spec, then spec.engine.args and the role's."""
        ...

    def transfer_env(self, spec: PDDeploymentSpec, role: Role) -> list[dict]:
        """The transfer's environment (core/v1 EnvVar dicts), after the pod's and before the user's."""
        ...

    def bootstrap_port(self, spec: PDDeploymentSpec) -> int:
        """The prefill's port routers and decodes reach besides HTTP."""
        ...

    def host_ipc(self, spec: PDDeploymentSpec) -> bool:
        """Whether the protocol needs the host's IPC namespace (CUDA IPC between pods)."""
        ...


class EnginePlugin(Protocol):
    """One ``spec.engine.kind``."""

    @property
    def kind(self) -> EngineKind: ...

    @property
    def rules(self) -> EngineRules:
        """Its rules keyed by version, owned flags and check harness (the runtime's plug-in of the kind)."""
        ...

    @property
    def worker(self) -> WorkerContract: ...

    @property
    def group_port(self) -> NamedPort:
        """The port a replica group's members reach their leader on (the group's headless Service)."""
        ...

    @property
    def container(self) -> EngineContainer | None:
        """The engine's own container; None: the runtime container is the engine (the built-in runtime)."""
        ...


class RouterPlugin(Protocol):
    """One ``spec.router.kind``."""

    @property
    def kind(self) -> RouterKind: ...

    def command(self, deployment: str, namespace: str, spec: PDDeploymentSpec,
                discovery: RouterDiscovery) -> list[str]:
        """The router's command line."""
        ...

    def containers(self, deployment: str, namespace: str, spec: PDDeploymentSpec, discovery: RouterDiscovery,
                   security: dict) -> list[dict]:
        """The router pod's containers; one named ``ROUTER_CONTAINER``, one port named ``http`` (the Service's)."""
        ...

    def volumes(self, deployment: str) -> list[dict]:
        """The router pod's volumes (the Secrets its containers mount)."""
        ...

    def admin_secret(self, deployment: str, namespace: str, key: str | None = None) -> dict | None:
        """The Secret created once for the router's own admin API; None when it has none."""
        ...

    def worker_annotations(self, role: Role) -> dict[str, str]:
        """What this router's discovery reads on a built-in runtime pod of ``role`` (an engine's pods carry their
        engine's own, ``EngineContainer.bootstrap_annotation``)."""
        ...

    def worker_args(self, role: Role) -> list[str]:
        """Flags of a built-in runtime pod's ``serve`` that this router's contract needs."""
        ...

"""What the engine rules read: one spec's engine per role (the seam between the operator and the rules).

Kept apart from the package's entry so the per-engine evaluators import it without a circle.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pdfleet_runtime.links import Backend, LinkProtocol
from pdfleet_runtime.roles import Role

__all__ = ["EngineInput", "EngineRoleInput", "role_env"]


@dataclass(frozen=True)
class EngineRoleInput:
    """One role's engine as written in the spec (shared settings already merged with the role's)."""

    version: str | None
    version_path: str
    args: tuple[str, ...] = ()
    arg_paths: tuple[str, ...] = ()
    env: tuple[tuple[str, str | None, str], ...] = ()  # (name, value or None for valueFrom, field path)
    tensor: int = 1
    pipeline: int = 1
    expert: int = 1
    data: int = 1
    nodes: int = 1


@dataclass(frozen=True)
class EngineInput:
    kind: str
    backend: Backend
    protocol: LinkProtocol
    prefill: EngineRoleInput
    decode: EngineRoleInput
    model: str | None = None  # layout preset
    state_types: frozenset[str] = frozenset()
    mla: bool = False
    staging_buffer: bool = False
    downloads_model: bool = False
    model_revision: str | None = None  # spec.model.source.huggingFace.revision (a commit)
    rdma_device_map: bool = False  # spec.transfer.rdmaDeviceMap is set
    roles: tuple[Role, ...] = field(default=(Role.PREFILL, Role.DECODE))
    kv_heads: int | None = None  # the layout's KV heads (hetero-TP rules)
    model_path: str = ""  # what the engine is given as the model (a handshake may hash the string)
    router_kind: str | None = None  # spec.router.kind as written (None: the engine's own, or no router)
    routed: bool = False  # spec.router is set: the operator renders a router with Kubernetes discovery

    def of(self, role: Role) -> EngineRoleInput:
        """The engine of one role."""
        return self.prefill if role is Role.PREFILL else self.decode


def role_env(table: Sequence[tuple[str, str, str]], inp: EngineInput,
             role: Role) -> list[tuple[str, str | None, str]]:
    """The engine container's environment from the spec, in order (later entries win in a pod): ``table``,
    what the engine kind renders from the spec (its ``EngineRules.table_env``), then the user's (shared,
    then the role's)."""
    return [*table, *inp.of(role).env]

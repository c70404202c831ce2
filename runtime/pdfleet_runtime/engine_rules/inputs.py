"""What the engine rules read: one spec's engine per role, and the environment it renders.

Kept apart from the package's entry so the per-engine evaluators import it without a circle.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdfleet_runtime.engine_rules import sglang
from pdfleet_runtime.links import Backend, LinkProtocol
from pdfleet_runtime.roles import Role

__all__ = ["EngineInput", "EngineRoleInput", "role_env", "table_env"]


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
    rdma_device_map: bool = False  # spec.transfer.rdmaDeviceMap is set
    roles: tuple[Role, ...] = field(default=(Role.PREFILL, Role.DECODE))
    kv_heads: int | None = None  # the layout's KV heads (vLLM's hetero-TP rule)
    model_path: str = ""  # what the engine is given as the model (vLLM hashes the string)
    router_kind: str | None = None  # spec.router.kind as written (None: the engine's own, or no router)

    def of(self, role: Role) -> EngineRoleInput:
        """The engine of one role."""
        return self.prefill if role is Role.PREFILL else self.decode


def table_env(inp: EngineInput) -> list[tuple[str, str, str]]:
    """(name, value, field path) the spec renders: the protocol table's, then the staging buffer's."""
    out: list[tuple[str, str, str]] = []
    if inp.kind == "vllm":
        from pdfleet_runtime.engine_rules.vllm_render import transfer_env

        return [(k, v, "spec.transfer") for k, v in transfer_env(inp.backend, inp.protocol, None)]
    settings = sglang.PROTOCOLS.get((inp.backend, inp.protocol))
    if settings is not None:
        out += [(k, v, "spec.transfer.protocol") for k, v in settings.env.items()]
    if inp.staging_buffer:
        out.append((sglang.STAGING_BUFFER_ENV, "1", "spec.engine.stagingBuffer"))
    return out


def role_env(inp: EngineInput, role: Role) -> list[tuple[str, str | None, str]]:
    """The engine container's environment from the spec, in order (later entries win in a pod):
    ``table_env``, then the user's (shared, then the role's)."""
    return [*table_env(inp), *inp.of(role).env]

"""A spec's engine per role: spec.engine merged with the role's override, and the engine rules' input.

Rendering (``resources.engine``) and admission (``validation``) both read a role's engine from here,
so the flags the rules check are the flags the pod runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdfleet_operator.api.constants import Role
from pdfleet_operator.api.models import EngineKind, PDDeploymentSpec
from pdfleet_runtime.engine_rules import EngineInput, EngineRoleInput, rules_of
from pdfleet_runtime.layouts import AttentionKind, LayoutError, resolve_layout

__all__ = ["RoleEngine", "engine_input", "revision_flags", "role_engine"]


@dataclass(frozen=True)
class RoleEngine:
    """One role's effective engine settings, each with the field path it came from."""

    kind: EngineKind
    version: str | None
    version_path: str
    image: str | None
    args: tuple[str, ...]
    arg_paths: tuple[str, ...]
    env: tuple[dict, ...]  # core/v1 EnvVar dicts, shared then the role's
    env_paths: tuple[str, ...]


def revision_flags(spec: PDDeploymentSpec) -> list[str]:
    """``--revision COMMIT`` where the spec pins the Hub model's commit: SGLang 0.5.23 and vLLM 0.33.0 both take
    it (and vLLM's tokenizer follows it), so every pod of both roles loads that commit."""
    src = spec.model.source
    rev = src.hugging_face.revision if src is not None and src.hugging_face is not None else None
    return [] if rev is None else ["--revision", rev]


def role_engine(spec: PDDeploymentSpec, role: Role) -> RoleEngine:
    eng = spec.engine
    rs = spec.prefill if role is Role.PREFILL else spec.decode
    over = rs.engine
    prefix = f"spec.{role.value}.engine"
    if eng is None:
        return RoleEngine(EngineKind.PDFLEET, None, "spec.engine.version", None, (), (), (), ())
    version, version_path = eng.version, "spec.engine.version"
    if over is not None and over.version is not None:
        version, version_path = over.version, f"{prefix}.version"
    image = over.image if over is not None and over.image is not None else eng.image
    args = [(a, f"spec.engine.args[{i}]") for i, a in enumerate(eng.args or ())]
    args += [(a, f"{prefix}.args[{i}]") for i, a in enumerate((over.args if over else None) or ())]
    env = [(e, f"spec.engine.env[{i}]") for i, e in enumerate(eng.env or ())]
    env += [(e, f"{prefix}.env[{i}]") for i, e in enumerate((over.env if over else None) or ())]
    return RoleEngine(
        eng.kind, version, version_path, image,
        tuple(a for a, _ in args), tuple(p for _, p in args),
        tuple(e.model_dump(mode="json", by_alias=True, exclude_none=True) for e, _ in env),
        tuple(p for _, p in env),
    )


def _role_input(spec: PDDeploymentSpec, role: Role) -> EngineRoleInput:
    e = role_engine(spec, role)
    rs = spec.prefill if role is Role.PREFILL else spec.decode
    env = tuple((d["name"], d.get("value", "" if "valueFrom" not in d else None), p)
                for d, p in zip(e.env, e.env_paths, strict=True))
    p = rs.parallelism
    return EngineRoleInput(e.version, e.version_path, e.args, e.arg_paths, env,
                           p.tensor, p.pipeline, p.expert, p.data, p.nodes_per_replica)


def engine_input(spec: PDDeploymentSpec) -> EngineInput | None:
    """The engine rules' view of a spec; None where no engine container is checked (the built-in runtime)."""
    rules = None if spec.engine is None else rules_of(spec.engine.kind.value)
    if spec.engine is None or rules is None or not rules.checked:
        return None
    try:
        layout = resolve_layout(spec.model.layout)
        states = frozenset(str(s) for s in layout.state_types())
        mla = layout.attention_kind is AttentionKind.MLA
        kv_heads: int | None = layout.kv_heads
    except (LayoutError, ValueError):
        states, mla, kv_heads = frozenset(), False, None
    source = spec.model.source
    model_path = "" if source is None else source.path or (source.hugging_face.id if source.hugging_face else "")
    return EngineInput(
        kind=spec.engine.kind.value,
        backend=spec.transfer.backend,
        protocol=spec.transfer.protocol,
        prefill=_role_input(spec, Role.PREFILL),
        decode=_role_input(spec, Role.DECODE),
        model=spec.model.layout.preset,
        state_types=states,
        mla=mla,
        staging_buffer=spec.engine.staging_buffer,
        downloads_model=source is not None and source.hugging_face is not None,
        model_revision=source.hugging_face.revision if source is not None and source.hugging_face else None,
        rdma_device_map=bool(spec.transfer.rdma_device_map),
        kv_heads=kv_heads,
        model_path=model_path,
        router_kind=spec.router.kind.value if spec.router is not None and spec.router.kind is not None else None,
        routed=spec.router is not None,
    )

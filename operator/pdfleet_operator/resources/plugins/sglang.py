"""SGLang as an engine kind: ``python3 -m sglang.launch_server`` in the ``engine`` container beside the agent.

Full flag names (``--tp``/``--dp`` work only as argparse abbreviations); the flag and environment tables
live in ``pdfleet_runtime.engine_rules.sglang`` (docs/sglang.md prints them). The pod around the command
is the generic engine pod (``resources.engine.with_engine``).
"""

from __future__ import annotations

import json

from pdfleet_operator.api.constants import Role
from pdfleet_operator.api.models import EngineKind, PDDeploymentSpec, PoolSpec, RoleSpec
from pdfleet_operator.engine import engine_input, revision_flags, role_engine
from pdfleet_operator.resources.plugins.contract import GroupMember, NamedPort, WorkerContract
from pdfleet_runtime.engine_rules import EngineRules
from pdfleet_runtime.engine_rules.sglang import BOOTSTRAP_PORT, DIST_INIT_PORT, ENGINE_PORT, PROTOCOLS
from pdfleet_runtime.engine_rules.sglang_plugin import SGLANG as SGLANG_RULES
from pdfleet_runtime.links import LinkProtocol

__all__ = ["ANNOTATION_BOOTSTRAP_PORT", "SGLANG", "SGLangContainer", "SGLangEngine"]

ANNOTATION_BOOTSTRAP_PORT = "sglang.ai/bootstrap-port"  # SGLang's router reads it (hard-coded there)
_DEFAULT_KV_TOKENS = PoolSpec().kv_tokens_per_replica


def _ib_device(spec: PDDeploymentSpec) -> str | None:
    t = spec.transfer
    settings = PROTOCOLS.get((t.backend, t.protocol))
    if settings is None or not settings.ib_device:
        return None
    if t.rdma_device_map:
        return json.dumps({k: ",".join(v) for k, v in sorted(t.rdma_device_map.items(), key=lambda kv: int(kv[0]))},
                          separators=(",", ":"))
    return ",".join(t.rdma_devices) if t.rdma_devices else None


def _model_path(spec: PDDeploymentSpec) -> str:
    src = spec.model.source
    if src is not None and src.path is not None:
        return src.path
    if src is None or src.hugging_face is None:  # admission denies it (engine-model-source)
        raise ValueError("spec.model.source is required for an SGLang engine")
    return src.hugging_face.id


def _parallel_flags(rs: RoleSpec, member: GroupMember | None) -> list[str]:
    """Attention DP and EP inside TP (``--attn-dp-size``: the deprecated ``--enable-dp-attention`` is
    never rendered), and a replica group's rendezvous when it spans nodes (``--dist-init-addr``: the group's
    first pod on the rendezvous port)."""
    p = rs.parallelism
    out: list[str] = []
    if p.data > 1:
        out += ["--attn-dp-size", str(p.data)]
    if p.expert > 1:
        out += ["--ep-size", str(p.expert)]
    if p.nodes_per_replica > 1:
        if member is None:
            raise ValueError("a replica spanning nodes needs its group member (node rank and first pod)")
        out += ["--nnodes", str(p.nodes_per_replica), "--node-rank", str(member.node_rank),
                "--dist-init-addr", f"{member.leader_host}:{DIST_INIT_PORT}"]
    return out


class SGLangContainer:
    """The ``engine`` container's SGLang parts."""

    bootstrap_annotation = ANNOTATION_BOOTSTRAP_PORT

    def command(self, name: str, spec: PDDeploymentSpec, role: Role, member: GroupMember | None) -> list[str]:
        rs = spec.prefill if role is Role.PREFILL else spec.decode
        settings = PROTOCOLS[(spec.transfer.backend, spec.transfer.protocol)]
        cmd = [
            "python3", "-m", "sglang.launch_server",
            "--model-path", _model_path(spec),
            *revision_flags(spec),
            "--served-model-name", spec.model.served_name or name,
            "--tp-size", str(rs.parallelism.tensor),
            "--pp-size", str(rs.parallelism.pipeline),
            *_parallel_flags(rs, member),
            "--disaggregation-mode", role.value,
            "--disaggregation-transfer-backend", settings.backend_flag,
            "--disaggregation-bootstrap-port", str(BOOTSTRAP_PORT),
        ]
        ib = _ib_device(spec)
        if ib is not None:
            cmd += ["--disaggregation-ib-device", ib]
        cmd += ["--host", "0.0.0.0", "--port", str(ENGINE_PORT), "--enable-metrics"]
        if rs.pool.kv_tokens_per_replica != _DEFAULT_KV_TOKENS:  # the default leaves SGLang's own sizing
            cmd += ["--max-total-tokens", str(rs.pool.kv_tokens_per_replica)]
        return cmd + list(role_engine(spec, role).args)

    def transfer_env(self, spec: PDDeploymentSpec, role: Role) -> list[dict]:
        """The protocol table's environment and the staging buffer's (the rules read the same list)."""
        inp = engine_input(spec)
        assert inp is not None
        return [{"name": n, "value": v} for n, v, _ in SGLANG_RULES.table_env(inp)]

    def bootstrap_port(self, spec: PDDeploymentSpec) -> int:
        return BOOTSTRAP_PORT

    def host_ipc(self, spec: PDDeploymentSpec) -> bool:
        settings = PROTOCOLS[(spec.transfer.backend, spec.transfer.protocol)]
        return settings.host_ipc or spec.transfer.protocol is LinkProtocol.NVLINK


class SGLangEngine:
    """``spec.engine.kind: sglang``."""

    kind = EngineKind.SGLANG
    rules: EngineRules = SGLANG_RULES
    worker = WorkerContract(port=ENGINE_PORT, health_path="/health")
    group_port = NamedPort(name="dist-init", port=DIST_INIT_PORT)  # --dist-init-addr (torch.distributed's store)
    container: SGLangContainer | None = SGLangContainer()


SGLANG = SGLangEngine()

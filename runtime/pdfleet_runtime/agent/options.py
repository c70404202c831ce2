"""What ``pdfleet-runtime agent`` runs with: the runtime config, the engine's declared facts, this pod.

The operator renders the flags from the spec (``resources/engine.py``): the engine version, the model
path the agent shares with the engine, and how long routers take to drop a worker whose pod is
deleted (``ROUTER_DROP_BOUND_S``, docs/router.md). Built once at start; nothing deeper reads the
environment.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pdfleet_runtime.agent.canary import PrefillTarget
from pdfleet_runtime.agent.dialect import EngineDialect, dialect_for
from pdfleet_runtime.config import GROUP_MEMBER_ENV, RuntimeConfig
from pdfleet_runtime.engine_rules import vllm
from pdfleet_runtime.engine_rules.sglang import BOOTSTRAP_PORT, ENGINE_PORT
from pdfleet_runtime.pod.options import OptionsError

__all__ = ["AgentOptions", "parse_prefill_targets"]


def parse_prefill_targets(text: str) -> tuple[PrefillTarget, ...]:
    """Local runs: ``host:httpPort:bootstrapPort,...`` instead of the prefill pods' headless Service."""
    out = []
    for item in (s.strip() for s in text.split(",") if s.strip()):
        parts = item.rsplit(":", 2)
        if len(parts) != 3 or not all(p.isdigit() for p in parts[1:]):
            raise OptionsError(f"--prefill-engines: {item!r} is not host:httpPort:bootstrapPort")
        out.append(PrefillTarget(parts[0], int(parts[1]), int(parts[2])))
    return tuple(out)


@dataclass(frozen=True)
class AgentOptions:
    config: RuntimeConfig
    engine_version: str
    engine_kind: str = "sglang"
    """``spec.engine.kind``: which dialect the agent speaks (``dialect.py``)."""
    model_path: Path | None = None
    """The model directory shared with the engine (its config.json is checked); None: not checked."""
    engine_url: str = f"http://127.0.0.1:{ENGINE_PORT}"
    engine_port: int = ENGINE_PORT
    """Prefill pods' engine port, as routers reach it (SGLang's and vLLM's, as the operator renders them)."""
    engine_bootstrap_port: int = BOOTSTRAP_PORT
    """SGLang's bootstrap port; vLLM's Mooncake bootstrap (the same number, as the operator renders it)."""
    router_drop_s: float = 4.0
    """A drain waits this long before it reads the engine's load: by then no router sends the pod work."""
    pod_name: str = ""
    pod_namespace: str = ""
    bind_host: str = "0.0.0.0"
    prefill_targets: tuple[PrefillTarget, ...] = ()
    """Local-run override of prefill discovery (DNS of ``prefillService`` otherwise)."""
    check_period_s: float = 5.0
    canary_period_s: float = 10.0
    retry_period_s: float = 1.0
    canary_timeout_s: float = 30.0
    failures_not_ready: int = 3
    gate: bool = True
    kubeconfig: Path | None = None
    log_level: str = "INFO"
    group_member: int = 0
    """This pod's node rank in its replica group (``PDFLEET_GROUP_MEMBER``); 0: the leader, or one node.
    A member's engine serves only ``/health`` (SGLang's node ranks >= 1): no canary, no load to drain."""

    @property
    def served_model(self) -> str:
        return self.config.served_model_name or self.config.deployment

    @property
    def dialect(self) -> EngineDialect:
        return dialect_for(self.engine_kind, self.config.backend, self.served_model)

    @classmethod
    def build(cls, config: RuntimeConfig, environ: Mapping[str, str], **flags: object) -> AgentOptions:
        targets = flags.pop("prefill_engines", None)
        member = environ.get(GROUP_MEMBER_ENV, "0")
        if not member.isdigit() or (config.group is None and member != "0") or (
                config.group is not None and int(member) >= config.group.nodes):
            raise OptionsError(f"{GROUP_MEMBER_ENV}={member!r} is not a member of this role's groups "
                               f"({config.group.nodes if config.group else 1} pods each)")
        opts = cls(config=config, engine_version=str(flags.pop("engine_version")), group_member=int(member),
                   pod_name=environ.get("POD_NAME", ""), pod_namespace=environ.get("POD_NAMESPACE", config.namespace),
                   prefill_targets=parse_prefill_targets(str(targets)) if targets else (),
                   **{**({} if config.canary_period_seconds is None  # the deployment's period; a flag wins
                         else {"canary_period_s": config.canary_period_seconds}),
                      **{k: v for k, v in flags.items() if v is not None}})  # type: ignore[arg-type]
        if min(opts.check_period_s, opts.canary_period_s, opts.retry_period_s, opts.canary_timeout_s) <= 0:
            raise OptionsError("the agent's periods and the canary timeout must be positive")
        try:
            opts.dialect  # noqa: B018 - an engine kind the agent cannot speak fails here, at start
        except ValueError as e:
            raise OptionsError(str(e)) from None
        if opts.engine_kind == "vllm":  # vLLM's ports as the operator renders them (vllm serve --port, Mooncake)
            opts = dataclasses.replace(opts, engine_port=vllm.ENGINE_PORT,
                                       engine_bootstrap_port=vllm.MOONCAKE_BOOTSTRAP_PORT,
                                       engine_url=str(flags.get("engine_url") or f"http://127.0.0.1:{vllm.ENGINE_PORT}"))
        if opts.router_drop_s < 0:
            raise OptionsError(f"--router-drop-seconds {opts.router_drop_s} must not be negative")
        return opts

"""``agent``: logging, the gate writer and the agent's event loop, from ``AgentOptions``."""

from __future__ import annotations

import asyncio
import logging

from pdfleet_runtime.agent.app import Agent
from pdfleet_runtime.agent.options import AgentOptions
from pdfleet_runtime.pod.gate import make_gate

__all__ = ["agent"]


def agent(opts: AgentOptions, *, in_cluster: bool = False) -> int:
    """Run the agent until SIGTERM (after its drain); the process exit code."""
    logging.basicConfig(level=opts.log_level, format="%(asctime)s %(levelname)s agent %(name)s: %(message)s")
    cfg = opts.config
    gate = make_gate(opts.gate and (in_cluster or opts.kubeconfig is not None), opts.pod_namespace or cfg.namespace,
                     opts.pod_name, cfg.readiness_gate, opts.kubeconfig)
    return asyncio.run(Agent(opts, gate=gate).run())

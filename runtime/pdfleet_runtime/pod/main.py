"""``serve``: logging, the gate writer and the pod server's event loop, from ``ServeOptions``."""

from __future__ import annotations

import asyncio
import logging

from pdfleet_runtime.protocol.keys import SecretError

from .app import PodServer
from .gate import make_gate
from .member import MemberServer
from .options import ServeOptions

__all__ = ["serve"]


def serve(opts: ServeOptions, *, in_cluster: bool = False) -> int:
    """Run one pod until SIGTERM (drained within ``drainTimeoutSeconds``); the process exit code."""
    logging.basicConfig(level=opts.log_level, format="%(asctime)s %(levelname)s pod %(name)s: %(message)s")
    cfg = opts.config
    gate = make_gate(opts.gate and (in_cluster or opts.kubeconfig is not None), opts.pod_namespace or cfg.namespace,
                     opts.pod_name, cfg.readiness_gate, opts.kubeconfig)
    if opts.is_member:  # a replica group's member: its ranks only, for its leader
        return asyncio.run(MemberServer(opts, gate=gate).run())
    try:
        pod = PodServer(opts, gate=gate)
    except SecretError as e:  # the worker key's file (workerKeyPath) missing or too short
        logging.getLogger("pdfleet_runtime.server").error("cannot start: %s", e)
        return 1
    return asyncio.run(pod.run())

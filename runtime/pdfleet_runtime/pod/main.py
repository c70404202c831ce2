"""``serve``: logging, the gate writer and the pod server's event loop, from ``ServeOptions``."""

from __future__ import annotations

import asyncio
import logging

from pdfleet_runtime.config import RuntimeConfig
from pdfleet_runtime.model.hub_cache import HubCacheError, evict, fill
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
    if not _fetch_model(cfg):
        return 1
    if opts.is_member:  # a replica group's member: its ranks only, for its leader
        return asyncio.run(MemberServer(opts, gate=gate).run())
    try:
        pod = PodServer(opts, gate=gate)
    except SecretError as e:  # the worker key's file (workerKeyPath) missing or too short
        logging.getLogger("pdfleet_runtime.server").error("cannot start: %s", e)
        return 1
    return asyncio.run(pod.run())


def _fetch_model(cfg: RuntimeConfig) -> bool:
    """A Hub model into the node's weights cache before any rank loads it (once per node and commit); False,
    logged with the reason, when it cannot be had (the pod exits and restarts, as an engine that cannot load)."""
    hub = cfg.model.hub if cfg.model is not None else None
    if hub is None:
        return True
    log = logging.getLogger("pdfleet_runtime.server.model")
    try:
        token = hub.token_path.read_text().strip() if hub.token_path is not None else None
        report = fill(hub.cache, hub.id, hub.commit, hub.endpoint, token=token, timeout_s=hub.timeout_seconds,
                      say=log.info)
    except (HubCacheError, OSError) as e:
        log.error("cannot fetch model %s@%s into the weights cache %s: %s", hub.id, hub.commit, hub.cache, e)
        return False
    log.info("%s", report.line(hub.id, hub.commit))
    evict(hub.cache, hub.id, hub.commit, say=log.info)  # the node's old commits no pod uses (never fails the pod)
    return True

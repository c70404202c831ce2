"""What the front passes to each router it stands in front of: its serving routes and whether it adds the key.

Pure (no aiohttp): the operator imports it to render the front's command and mounts. Everything outside a
kind's ``routes`` (the routers' worker and control endpoints) is answered 404 by the front and stays on the
router's loopback.

- sglang-router 0.3.2 (started with ``--api-key``) wants the worker key from its clients too: the front adds it.
- vllm-router 0.1.17 serves its worker API (``/add_worker``, ``/remove_worker``, ``/list_workers``,
  ``/flush_cache``, ``/get_loads``, ``/finish_session``, ``POST /workers``, ``DELETE /workers/{url}``) on its
  serving port without any key (its sdist's ``src/server.rs:930-944``); vLLM's workers take no pdfleet worker
  key, so the front adds none. Of its client routes (``src/server.rs:879-928``) the front passes the OpenAI
  completions and models routes and the probes: ``/generate`` and ``/health_generate`` are SGLang's (vLLM
  serves neither), and ``/v1/responses``, ``/v1/embeddings`` and ``/rerank`` are not checked in PD mode.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType

__all__ = ["FRONT_DRAIN_MAX_S", "FRONT_DRAIN_S", "FRONT_QUIET_S", "ROUTER_PRESTOP_S", "SURFACES", "FrontedRouter", "RouterSurface"]

FRONT_DRAIN_S = 5.0
"""After SIGTERM the front keeps serving at least this long, every answer closing its connection: the pod's
Service endpoint goes as its deletion starts, so clients reconnect to another router pod (a kept-alive connection
would otherwise stay on this one until it closed under a request: a router Deployment rolling, docs/router.md)."""
FRONT_QUIET_S = 2.0
"""...and then until no connection came for this long and none is open: kube-proxy takes the endpoint out when it
next syncs, late on a loaded node, and until then new connections still come here (a front that stopped listening
at a fixed 5 s would refuse them)."""
FRONT_DRAIN_MAX_S = 20.0
"""...but no longer than this after SIGTERM (a streaming answer may run for minutes)."""
ROUTER_PRESTOP_S = 24
"""The bound of the router container's preStop hook (``router-front-wait``: until the front stopped listening): it
outlives the front's longest drain and its last answers (2 s), within the pod's default 30 s grace period."""


class FrontedRouter(StrEnum):
    """The router behind the front (the operator's ``spec.router.kind`` values)."""

    SGLANG = "sglang"
    VLLM = "vllm"


@dataclass(frozen=True)
class RouterSurface:
    routes: Mapping[str, frozenset[str]]
    """What clients (and the kubelet's probes) may reach, by method; anything else is 404 at the front."""
    worker_key: bool
    """Whether the router wants the deployment's worker key from its clients (the front then adds it)."""


_PROBES = frozenset({"/health", "/readiness", "/liveness"})

SURFACES: Mapping[FrontedRouter, RouterSurface] = MappingProxyType({
    FrontedRouter.SGLANG: RouterSurface(
        routes=MappingProxyType({
            "POST": frozenset({"/v1/chat/completions", "/v1/completions", "/generate"}),
            "GET": frozenset({"/v1/models", "/health_generate"}) | _PROBES,
        }),
        worker_key=True,
    ),
    FrontedRouter.VLLM: RouterSurface(
        routes=MappingProxyType({
            "POST": frozenset({"/v1/chat/completions", "/v1/completions"}),
            "GET": frozenset({"/v1/models"}) | _PROBES,
        }),
        worker_key=False,
    ),
})

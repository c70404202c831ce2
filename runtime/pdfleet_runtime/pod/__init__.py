"""``pdfleet-runtime serve``'s pod process: HTTP, the worker API, rooms, routing, readiness, drain, metrics, the gate.

One pod process per pod; it starts one rank process per GPU rank (``rank/``: those run torch and the
engine) and talks to them over the rank pipe (``rank.pipe``, the one module of ``rank/`` it imports, with
``rank.entry``, the rank process's torch-free target). Reading order: ``options`` (what a pod runs with,
read once at start; the local-run overrides), ``launcher`` (one process per rank from a fork server, supervised),
``readiness`` (the pure verdict), ``routing`` (which prefill pod a request goes to, what its outcome means),
``drain`` (the drain's phases), ``router_checks`` (the routers' health checks during a drain), ``metrics``,
``gate`` (the pod readiness-gate condition), ``worker_api`` (the worker requests and answers, pure),
``rooms`` (a prefill pod's rooms held for a decode), ``model_text``, ``model_answer`` and ``model_stream`` (a
model pod's tokenizer and chat template, greedy answers cut at end of sequence or a stop string, and its
streaming events), ``openai_api`` (the worker API's endpoints, over the
narrow ``WorkerPod`` interface the app hands it), ``worker_auth`` (the worker key and the port's bounds),
``admin``, ``app`` (HTTP, the canary loop, the operator's drain requests, SIGTERM; the entry module),
``group`` (a replica group's leader: every rank of the replica, its members' over the group channel) and
``member`` (a group member pod: its ranks, for its leader), ``main``. docs/runtime-server.md describes
endpoints, metrics, readiness and drain.

Importing this package imports neither torch nor an engine: only the rank processes do (import-linter and
tests/server/test_pod_process.py hold it).
"""

from __future__ import annotations

from pdfleet_runtime.rank.pipe import FaultOptions

from .app import PodServer
from .drain import DrainPhase
from .gate import GateWriter, KubeGate, NoGate, make_gate
from .main import serve
from .options import (
    CANARY_FLOORS_GBPS,
    ENV_PORT_OFFSET,
    ENV_PREFILL_ADDRESSES,
    OptionsError,
    ServeOptions,
)
from .readiness import CanaryResult, Problem, Readiness, Verdict
from .routing import SyntheticResult

__all__ = [
    "CANARY_FLOORS_GBPS",
    "ENV_PORT_OFFSET",
    "ENV_PREFILL_ADDRESSES",
    "CanaryResult",
    "DrainPhase",
    "FaultOptions",
    "GateWriter",
    "KubeGate",
    "NoGate",
    "OptionsError",
    "PodServer",
    "Problem",
    "Readiness",
    "ServeOptions",
    "SyntheticResult",
    "Verdict",
    "make_gate",
    "serve",
]

"""``pdfleet-runtime serve``: the runtime pod server (one process per GPU rank, health, readiness, metrics, drain).

Reading order: ``options`` (what a pod runs with, read once at start; the local-run overrides),
``pipe`` (the typed messages between the pod process and its ranks), ``launcher`` (one spawned
process per rank, supervised), ``ranks`` (a rank process: pools, engine, protocol coordinator),
``rank_requests`` (what a rank does with a synthetic request), ``synthetic`` (seeded request state,
filled and verified), ``arena`` (a rank's seeded arena and whole-arena check, for the parity
harness that drives these same rank processes), ``readiness`` (the pure verdict),
``routing`` (which prefill pod a request goes to, what its outcome means), ``drain`` (the drain's
phases), ``metrics``, ``gate`` (the pod readiness-gate condition), ``app`` (HTTP, the canary loop,
the operator's drain requests, SIGTERM), ``group`` (a replica group's leader: every rank of the replica,
its members' over the group channel) and ``member`` (a group member pod: its ranks, for its leader),
``main``. docs/runtime-server.md describes endpoints, metrics,
readiness and drain.

Importing this package imports neither torch nor an engine: only the rank processes do.
"""

from __future__ import annotations

from .app import PodServer
from .drain import DrainPhase
from .gate import GateWriter, KubeGate, NoGate, make_gate
from .main import serve
from .options import (
    CANARY_FLOORS_GBPS,
    ENV_PORT_OFFSET,
    ENV_PREFILL_ADDRESSES,
    FaultOptions,
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

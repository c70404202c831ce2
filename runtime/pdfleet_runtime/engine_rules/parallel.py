"""What each engine does with attention data parallelism, expert parallelism and replicas across nodes
in PD, per transfer backend: the cells ``pdfleet matrix`` prints, each "no" with its rule and reason.

The rules themselves live where admission evaluates them (``matrix.GENERAL_RULES`` and the CRD's CEL
rules); this table is their per-backend summary, read from SGLang 0.5.23's disaggregation code: every
connector (mooncake, nixl, mori) shares ``disaggregation/common/conn.py``'s bootstrap, which addresses
the prefill side per attention DP rank (``prefill_dp_rank``; with the prefill's default
``--load-balance-method follow_bootstrap_room`` it is ``bootstrap_room % dp ranks``, so the router's
random room picks it and no DP-aware router flag is needed). Each DP rank owns whole requests, so a
request's state of every type moves between one prefill DP rank and one decode DP rank as at DP 1.
Pure data.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdfleet_runtime.links import Backend

__all__ = ["PARALLEL_CELLS", "ParallelCell"]


@dataclass(frozen=True, slots=True)
class ParallelCell:
    engine: str  # "pdfleet" (built-in runtime) or "sglang==0.5.23"
    feature: str  # "attention-dp", "expert-parallel", "multi-node"
    backend: Backend | None  # None: every backend
    supported: bool
    reason: str
    rule: str | None = None


_SGLANG = "sglang==0.5.23"
_COMMON = "python/sglang/srt/disaggregation/common/conn.py"
_GROUPS = ("a replica group: nodesPerReplica pods, one per node, created, drained and restarted as a unit; "
           "--nnodes/--node-rank/--dist-init-addr through the group's headless Service; only the first pod "
           "serves HTTP and the bootstrap (docs/parallelism.md)")

PARALLEL_CELLS: tuple[ParallelCell, ...] = (
    ParallelCell("pdfleet", "attention-dp", None, False,
                 "the runtime's planner and wire protocol address ranks by (TP, PP) only: no DP rank, so no "
                 "decode DP rank -> prefill DP rank mapping", "builtin-no-attention-dp"),
    ParallelCell("pdfleet", "expert-parallel", None, False,
                 "the runtime moves attention and linear state only; it has no MoE layers",
                 "builtin-no-expert-parallel"),
    *(ParallelCell("pdfleet", "multi-node", b, True,
                   "a replica group: member m runs ranks [m * local, (m + 1) * local); the leader serves HTTP and "
                   "the bootstrap and drives its members' ranks over the group channel (signed with the role's "
                   "group key)") for b in (Backend.MOONCAKE, Backend.NIXL)),
    *(ParallelCell(_SGLANG, "attention-dp", b, True,
                   f"every state type, per DP rank: the shared bootstrap routes by prefill_dp_rank ({_COMMON})")
      for b in (Backend.MOONCAKE, Backend.NIXL, Backend.MORI)),
    *(ParallelCell(_SGLANG, "expert-parallel", b, True,
                   "EP shards MoE weights only; transferred state is attention/linear state, unchanged by EP")
      for b in (Backend.MOONCAKE, Backend.NIXL, Backend.MORI)),
    *(ParallelCell(_SGLANG, "multi-node", b, True, _GROUPS) for b in (Backend.MOONCAKE, Backend.NIXL, Backend.MORI)),
)

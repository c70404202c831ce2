"""The capability matrix: which (layout, backend, protocol, prefill shape, decode shape) can serve.

Reading order: ``Rule`` and ``Cell`` (the data) -> ``MATRICES`` (one matrix per version) ->
``MatrixInput`` (what is evaluated) -> ``evaluate`` (the pure, total function).

Why this shape:
- The rules are data (id, reason, fix) so ``pdfleet matrix`` and ``pdfleet explain-rule`` print the
  same text the admission webhook returns, and a backend's "no" cells are rows of a table rather
  than branches spread through code.
- ``evaluate`` never raises and never stops at the first problem: a user fixes every violation in
  one edit, and the webhook on the apiserver's request path cannot fall over. Every rule check is
  guarded; an unexpected error becomes a ``matrix-internal-error`` violation, never an exception.
- Matrices are versioned: a runtime release maps to the matrix it implements (``versions.py``), so
  a stored object can be re-checked after an upgrade, and a spec mixing two runtimes is checked
  against both matrices (a combination must work for both).

Pure: imports no torch and no engine; the operator imports it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from functools import cached_property
from types import MappingProxyType

from pdfleet_runtime.layouts import (
    AttentionKind,
    IndexKind,
    Layout,
    LayoutError,
    LayoutRef,
    item_bytes_by_kind,
    pool_counts,
    resolve_layout,
)
from pdfleet_runtime.links import UNSUPPORTED_PROTOCOLS, Backend, LinkProtocol
from pdfleet_runtime.model.weights import PRESET_WEIGHT_BYTES
from pdfleet_runtime.roles import Role
from pdfleet_runtime.versions import CURRENT_RUNTIME_VERSION, RUNTIME_RELEASES, RuntimeRelease, release_of

__all__ = [
    "INDEX_STATES",
    "LATEST_MATRIX_VERSION",
    "MATRICES",
    "PLE_STATES",
    "QSA_STATES",
    "Cell",
    "Feature",
    "LayoutFacts",
    "Matrix",
    "MatrixInput",
    "RoleInput",
    "Rule",
    "Severity",
    "Verdict",
    "Violation",
    "all_rules",
    "evaluate",
    "evaluate_rule",
    "explain_rule",
    "layout_facts",
    "matrix_input",
]

QSA_STATES = frozenset({"qsa_pending", "qsa_compressed"})
PLE_STATES = frozenset({"ple_short_conv", "ple_ngram"})
INDEX_STATES = frozenset({"index_k", "positions"})  # raw per-token index keys and positions: replicated pages
_GIB = 1 << 30


class Severity(StrEnum):
    ERROR = "error"      # the spec is refused
    WARNING = "warning"  # legal but risky; admission returns it as a warning


class Feature(StrEnum):
    """A column of the matrix: something a backend can or cannot do."""

    PIPELINE = "pipeline"
    QSA_PIPELINE = "qsa-pipeline"
    SHARDED_HETERO_TP = "sharded-hetero-tp"
    REPLICATED_HETERO_TP = "replicated-hetero-tp"
    QSA_HETERO_TP_MHA = "qsa-hetero-tp-mha"
    QSA_HETERO_TP_MLA = "qsa-hetero-tp-mla"
    PROTOCOL_RDMA = "protocol-rdma"
    PROTOCOL_TCP = "protocol-tcp"
    PROTOCOL_NVLINK = "protocol-nvlink"
    PROTOCOL_SHM = "protocol-shm"


FEATURE_TITLES: Mapping[Feature, str] = MappingProxyType({
    Feature.PIPELINE: "pipeline parallelism > 1 (layer-id pairing)",
    Feature.QSA_PIPELINE: "QSA state with pipeline parallelism > 1",
    Feature.SHARDED_HETERO_TP: "sharded state (KV heads, Mamba) across different TP sizes",
    Feature.REPLICATED_HETERO_TP: "replicated linear-state siblings (PLE) across different TP sizes",
    Feature.QSA_HETERO_TP_MHA: "QSA state across different TP sizes, non-MLA model",
    Feature.QSA_HETERO_TP_MLA: "QSA state across different TP sizes, MLA model",
    Feature.PROTOCOL_RDMA: "protocol rdma",
    Feature.PROTOCOL_TCP: "protocol tcp",
    Feature.PROTOCOL_NVLINK: "protocol nvlink",
    Feature.PROTOCOL_SHM: "protocol shm",
})
_PROTOCOL_FEATURE: Mapping[LinkProtocol, Feature] = MappingProxyType({
    LinkProtocol.RDMA: Feature.PROTOCOL_RDMA,
    LinkProtocol.TCP: Feature.PROTOCOL_TCP,
    LinkProtocol.NVLINK: Feature.PROTOCOL_NVLINK,
    LinkProtocol.SHM: Feature.PROTOCOL_SHM,
})


@dataclass(frozen=True, slots=True)
class Rule:
    """One rule: its id (stable, printed everywhere), why it exists, and how to fix a violation."""

    id: str
    title: str
    reason: str
    fix: str
    severity: Severity = Severity.ERROR
    backend: Backend | None = None  # None: applies to every backend


@dataclass(frozen=True, slots=True)
class Cell:
    """One (backend, feature) cell; a "no" carries the rule that enforces it."""

    backend: Backend
    feature: Feature
    supported: bool
    reason: str = ""
    rule_id: str | None = None


@dataclass(frozen=True, slots=True)
class Violation:
    rule: str
    message: str
    paths: tuple[str, ...]
    reason: str
    fix: str
    severity: Severity = Severity.ERROR
    matrix_version: str = ""

    def as_dict(self) -> dict[str, object]:
        return {
            "rule": self.rule, "severity": str(self.severity), "paths": list(self.paths),
            "message": self.message, "reason": self.reason, "fix": self.fix,
            "matrixVersion": self.matrix_version,
        }


@dataclass(frozen=True, slots=True)
class Verdict:
    """All violations (errors) and warnings of one evaluation, and the matrices it used."""

    violations: tuple[Violation, ...]
    warnings: tuple[Violation, ...] = ()
    matrix_versions: tuple[str, ...] = ()

    @property
    def admitted(self) -> bool:
        return not self.violations


@dataclass(frozen=True, slots=True)
class LayoutFacts:
    """What the matrix needs to know about a model's state, with the field path of each fact.

    ``pool_bytes(tp, pp, max_requests, kv_tokens)`` is the per-rank bytes of every pool; None when
    unknown (the pool rule is then skipped). ``paths`` maps a fact name (``kv_heads``, ``page_size``,
    ``linear_heads``, ``qsa_compress_ratio``, ``num_layers``) to the field a user edits; a preset
    points every fact at ``spec.model.layout.preset``.
    """

    name: str
    num_layers: int
    state_types: frozenset[str]
    mla: bool
    kv_heads: int
    page_size: int
    linear_heads: tuple[int, ...] = ()
    qsa_compress_ratio: int | None = None
    pool_bytes: Callable[[int, int, int, int], int] | None = None
    paths: Mapping[str, str] = field(default_factory=dict)
    weight_bytes: int | None = None  # the model's weights (a preset's real model, or the layout's weightBytes)
    conv_group_heads: tuple[int, ...] = ()  # declared conv channel groups' heads (Mamba2 x|B|C), () for q|k|v

    def path(self, fact: str) -> str:
        return self.paths.get(fact, "spec.model.layout")


@dataclass(frozen=True, slots=True)
class RoleInput:
    """One role as the matrix reads it: the spec's values as given, unvalidated (the matrix reports what is
    wrong, with its path), so not a ``records.ParallelShape``, which refuses a bad shape when built.
    Replicas and pod settings do not matter here."""

    tensor: int
    pipeline: int = 1
    data: int = 1
    expert: int = 1
    nodes_per_replica: int = 1
    runtime_version: str = CURRENT_RUNTIME_VERSION
    max_requests: int = 64
    kv_tokens: int = 131072
    gpu_memory_gib: float = 141.0


@dataclass(frozen=True, slots=True)
class MatrixInput:
    """Everything one evaluation reads. ``layout`` is None when the spec's layout did not resolve."""

    layout: LayoutFacts | None
    backend: Backend | str
    protocol: LinkProtocol | str
    prefill: RoleInput
    decode: RoleInput
    engine: str = "pdfleet"  # spec.engine.kind: the built-in runtime has no attention DP or EP


@dataclass(frozen=True)
class Matrix:
    """One version of the matrix: the backend cells plus the limits the general rules use."""

    version: str
    cells: Mapping[tuple[Backend, Feature], Cell]
    gpu_memory_fraction: float = 0.9  # the rest is weights' neighbours: activations, CUDA graphs, NCCL

    def supports(self, backend: Backend, feature: Feature) -> Cell:
        return self.cells.get((backend, feature)) or Cell(backend, feature, True)

    @cached_property
    def rules(self) -> Mapping[str, Rule]:
        """Every rule of this version, general ones first, then one per backend "no" cell."""
        out = dict(GENERAL_RULES)
        for cell in self.cells.values():
            if not cell.supported and cell.rule_id:
                out[cell.rule_id] = Rule(
                    cell.rule_id, f"{cell.backend}: {FEATURE_TITLES[cell.feature]} unsupported",
                    cell.reason, _CELL_FIX[cell.feature], backend=cell.backend,
                )
        return MappingProxyType(out)


# -- the rules that hold for every backend ---------------------------------------------------------

def _r(id: str, title: str, reason: str, fix: str, severity: Severity = Severity.ERROR) -> tuple[str, Rule]:
    return id, Rule(id, title, reason, fix, severity)


GENERAL_RULES: Mapping[str, Rule] = MappingProxyType(dict([
    _r("input-invalid", "the matrix cannot read a field",
       "a field the matrix needs is missing, of the wrong type, or out of range",
       "fix the named field; `pdfleet validate` lists the schema errors too"),
    _r("layout-unresolved", "the model layout does not resolve",
       "the layout names an unknown preset or an inline layout that is not consistent",
       "use a preset listed by `kubectl explain pdd.spec.model.layout.preset` or fix the inline layout"),
    _r("attn-dp-divides-tp", "attention data parallelism must divide TP",
       "SGLang splits a replica's TP ranks into parallelism.data attention groups of tensor/data ranks "
       "(server_args: tp_size % attn_dp_size == 0, checked at start)",
       "set parallelism.data to a divisor of parallelism.tensor (e.g. data = tensor for DeepSeek MLA)"),
    _r("ep-divides-tp", "expert parallelism must divide TP",
       "SGLang runs the MoE layers on ep_size x moe_tp_size = tp_size ranks; an EP size that does not divide "
       "TP leaves a fractional MoE TP size and the model fails to load",
       "set parallelism.expert to a divisor of parallelism.tensor (usually equal to it)"),
    _r("nodes-divide-gpus", "nodesPerReplica must divide the replica's GPUs",
       "every pod of a replica group holds tensor x pipeline / nodesPerReplica GPUs (SGLang: "
       "(tp_size x pp_size) % nnodes == 0, checked at start)",
       "set nodesPerReplica to a divisor of tensor x pipeline (8 GPUs per node: tensor x pipeline / 8)"),
    _r("builtin-no-attention-dp", "the built-in runtime has no attention data parallelism",
       "the pdfleet runtime's planner and wire protocol address ranks by (TP, PP) only: there is no DP rank, so "
       "no mapping of a decode DP rank to the prefill DP rank that holds a request's state",
       "set parallelism.data to 1, or run SGLang (spec.engine.kind: sglang)"),
    _r("builtin-no-expert-parallel", "the built-in runtime has no expert parallelism",
       "the pdfleet runtime moves attention and linear state only; it has no MoE layers to place experts of",
       "set parallelism.expert to 1, or run SGLang (spec.engine.kind: sglang)"),
    _r("tp-divisible", "prefill and decode TP sizes must divide one another",
       "state is sliced (scatter) or aggregated with one elected writer per group; both need one TP "
       "size to be a multiple of the other",
       "pick TP sizes such as 8/4, 4/4, 2/8 (one divides the other)"),
    _r("pp-match", "decode PP must equal prefill PP or be 1",
       "layers pair by global layer id: a decode stage must hold exactly the layers of one prefill "
       "stage, or all of them (PP=1, pulling from every prefill stage)",
       "set spec.decode.parallelism.pipeline to 1 or to the prefill's pipeline size"),
    _r("pp-layers", "pipeline stages must not outnumber layers",
       "every pipeline stage must own at least one layer",
       "lower parallelism.pipeline to at most the model's number of layers"),
    _r("kv-heads-tp", "TP and KV heads must divide one another",
       "a rank holds max(1, H/TP) whole KV heads; heads cannot be split across ranks, and when TP > H "
       "each head is replicated on exactly TP/H ranks (with attention DP, TP here is the attention TP: "
       "TP / attention DP, as SGLang shards heads)",
       "pick a TP that divides the KV head count or is a multiple of it"),
    _r("linear-heads-tp", "linear-attention heads must be divisible by TP",
       "linear-attention (Mamba/GDN) state is sharded by head along one axis; a rank must own whole heads",
       "pick a TP that divides every linear-attention head count of the layout"),
    _r("conv-groups-tp", "TP and each conv channel group's heads must divide one another",
       "a rank holds its share of a group's heads, or one whole head replicated on TP/heads ranks (Mamba2's B and "
       "C with n_groups below TP); a head cannot be split across ranks",
       "pick a TP that divides every linearAttention.convGroups heads count or is a multiple of it"),
    _r("qsa-page-ratio", "page size must be a multiple of the QSA compress ratio",
       "one compressed QSA page covers one full-KV page, so a page must hold a whole number of "
       "compressed entries",
       "set pageSize to a multiple of qsa.compressRatio"),
    _r("pool-fits-gpu", "weights and pools must fit the GPU memory of one device",
       "every rank holds its share of the model's weights (weights / (tensor x pipeline); a preset counts the "
       "real model it stands for, an inline layout its weightBytes) and allocates its KV and state pools at "
       "start; more than the device holds fails at start",
       "raise parallelism.tensor or pipeline, lower pool.kvTokensPerReplica or "
       "pool.maxConcurrentRequests, or set gpuMemoryGiB to the real device"),
    _r("runtime-version-unknown", "the runtime version is unknown to this matrix",
       "the operator cannot tell what an unknown runtime can move or which wire protocol it speaks",
       "use a runtime version this operator knows (`pdfleet matrix` lists them) or upgrade the operator"),
    _r("runtime-protocol-mismatch", "prefill and decode runtimes must speak one wire protocol",
       "ranks refuse a handshake with a peer whose wire protocol major differs; no request could transfer",
       "run both roles on runtime versions with the same wire protocol major"),
    _r("matrix-internal-error", "the matrix failed to evaluate a rule",
       "a bug in the matrix; the spec is refused rather than admitted unchecked",
       "report it with the manifest"),
    _r("warn-tcp-transfer", "transfer over TCP", "TCP moves state 100-200x slower than RDMA or NVLink",
       "use rdma (across nodes) or nvlink (one node) in production", Severity.WARNING),
    _r("warn-same-node-protocol", "protocol needs prefill and decode on one node",
       "nvlink and shm reach only GPUs of one host; the operator grants hostIPC to pods for it",
       "co-locate prefill and decode (nodeSelector/affinity) or use rdma", Severity.WARNING),
    _r("warn-mori-rocm", "MORI needs the ROCm runtime",
       "MORI's library links the ROCm runtime; its backend fails at start where that is absent",
       "run on AMD GPU nodes with ROCm, or use mooncake/nixl", Severity.WARNING),
    _r("warn-kv-heads-replicated", "TP larger than KV heads replicates heads",
       "when TP > H every KV head is stored on TP/H ranks: KV pool memory is spent TP/H times",
       "consider a TP no larger than the KV head count", Severity.WARNING),
]))

_CELL_FIX: Mapping[Feature, str] = MappingProxyType({
    Feature.PIPELINE: "set parallelism.pipeline to 1 in both roles, or use mooncake",
    Feature.QSA_PIPELINE: "set parallelism.pipeline to 1 in both roles, or use mooncake",
    Feature.SHARDED_HETERO_TP: "use equal prefill and decode TP, or use mooncake",
    Feature.REPLICATED_HETERO_TP: "use equal prefill and decode TP, or use mooncake",
    Feature.QSA_HETERO_TP_MHA: "use equal prefill and decode TP, or use mooncake",
    Feature.QSA_HETERO_TP_MLA: "use equal prefill and decode TP, or use mooncake",
    Feature.PROTOCOL_RDMA: "pick a protocol the backend serves (`pdfleet matrix`)",
    Feature.PROTOCOL_TCP: "pick a protocol the backend serves (`pdfleet matrix`)",
    Feature.PROTOCOL_NVLINK: "pick a protocol the backend serves (`pdfleet matrix`)",
    Feature.PROTOCOL_SHM: "pick a protocol the backend serves (`pdfleet matrix`)",
})


def _no(backend: Backend, feature: Feature, reason: str) -> Cell:
    return Cell(backend, feature, False, reason, f"{backend}.{feature}")


def _cells(*nos: Cell) -> Mapping[tuple[Backend, Feature], Cell]:
    out = {(b, f): Cell(b, f, True) for b in Backend for f in Feature}
    out.update({(c.backend, c.feature): c for c in nos})
    return MappingProxyType(out)


_MORI_NO_LAYER_IDS = (
    "MORI's handshake does not exchange per-peer state layer ids, so layer-id pairing is impossible"
)
MATRIX_V1 = Matrix(
    version="1",
    cells=_cells(
        _no(Backend.MORI, Feature.QSA_PIPELINE, _MORI_NO_LAYER_IDS),
        _no(Backend.MORI, Feature.QSA_HETERO_TP_MHA, "MORI cannot slice or elect writers for QSA state"),
        _no(Backend.MORI, Feature.QSA_HETERO_TP_MLA, "MORI cannot slice or elect writers for QSA state"),
        _no(Backend.MORI, Feature.REPLICATED_HETERO_TP,
            "MORI cannot elect one writer for replicated state (PLE, index keys, replicated conv groups) "
            "across TP sizes"),
        _no(Backend.NIXL, Feature.REPLICATED_HETERO_TP,
            "NIXL's sender does not elect one writer for replicated state (PLE, index keys, replicated conv "
            "groups) across TP sizes"),
        _no(Backend.NIXL, Feature.QSA_HETERO_TP_MHA,
            "NIXL maps QSA state across TP sizes only along MLA's replicated latent layout"),
        *(_no(b, _PROTOCOL_FEATURE[p], why) for (b, p), why in UNSUPPORTED_PROTOCOLS.items()),
    ),
)

MATRICES: Mapping[str, Matrix] = MappingProxyType({MATRIX_V1.version: MATRIX_V1})
LATEST_MATRIX_VERSION = MATRIX_V1.version


def all_rules() -> Mapping[str, Rule]:
    """Every rule of every matrix version (the newest definition wins)."""
    out: dict[str, Rule] = {}
    for m in MATRICES.values():
        out.update(m.rules)
    return MappingProxyType(out)


def explain_rule(rule_id: str) -> Rule | None:
    return all_rules().get(rule_id)


# -- evaluation ------------------------------------------------------------------------------------

_ROLES = ((Role.PREFILL, "spec.prefill"), (Role.DECODE, "spec.decode"))


def _pos_int(x: object) -> int | None:
    return x if type(x) is int and x >= 1 else None


class _Ctx:
    """Inputs read once and checked for type, so each rule is a few comparisons."""

    __slots__ = ("attn_dp", "backend", "inp", "layout", "matrix", "protocol", "shapes")

    def __init__(self, inp: MatrixInput, matrix: Matrix) -> None:
        self.inp = inp
        self.matrix = matrix
        self.layout = inp.layout if isinstance(inp.layout, LayoutFacts) else None
        self.backend = Backend(inp.backend) if inp.backend in _BACKENDS else None
        self.protocol = LinkProtocol(inp.protocol) if inp.protocol in _PROTOCOLS else None
        # role -> (tp, pp) when both are readable
        self.shapes: dict[Role, tuple[int, int] | None] = {}
        self.attn_dp: dict[Role, int] = {}
        for role, _ in _ROLES:
            shape = getattr(inp, role, None)
            tp = _pos_int(getattr(shape, "tensor", None))
            pp = _pos_int(getattr(shape, "pipeline", None))
            self.shapes[role] = (tp, pp) if tp and pp else None
            # attention DP groups inside TP (SGLang's attn_dp_size); 1 when unset or not dividing TP (a rule says why)
            dp = _pos_int(getattr(shape, "data", 1)) or 1
            self.attn_dp[role] = dp if tp and tp % dp == 0 else 1

    def attn_tp(self, role: Role) -> int:
        """The attention TP size of ``role``: TP / attention DP. KV heads and linear-attention heads are
        sharded over it (SGLang's attn_tp_size), not over the whole TP."""
        shape = self.shapes[role]
        assert shape is not None
        return shape[0] // self.attn_dp[role]

    def violation(self, rule_id: str, message: str, *paths: str) -> Violation:
        rule = self.matrix.rules[rule_id]
        return Violation(rule.id, message, paths, rule.reason, rule.fix, rule.severity, self.matrix.version)


_BACKENDS = frozenset(b.value for b in Backend)
_PROTOCOLS = frozenset(p.value for p in LinkProtocol)
Check = Callable[[_Ctx], Iterable[Violation]]


def _check_inputs(c: _Ctx) -> Iterator[Violation]:
    if c.backend is None:
        yield c.violation("input-invalid", f"unknown backend {c.inp.backend!r}", "spec.transfer.backend")
    if c.protocol is None:
        yield c.violation("input-invalid", f"unknown protocol {c.inp.protocol!r}", "spec.transfer.protocol")
    for role, prefix in _ROLES:
        shape = getattr(c.inp, role, None)
        if not isinstance(shape, RoleInput):
            yield c.violation("input-invalid", f"{role} is missing", prefix)
            continue
        for attr, path in _ROLE_INT_FIELDS:
            if _pos_int(getattr(shape, attr)) is None:
                yield c.violation("input-invalid", f"must be an integer >= 1, got {getattr(shape, attr)!r}",
                                  f"{prefix}.{path}")
        gib = shape.gpu_memory_gib
        if type(gib) not in (int, float) or not math.isfinite(gib) or gib <= 0:
            yield c.violation("input-invalid", f"must be a number > 0, got {gib!r}", f"{prefix}.gpuMemoryGiB")


_ROLE_INT_FIELDS = (
    ("tensor", "parallelism.tensor"), ("pipeline", "parallelism.pipeline"), ("data", "parallelism.data"),
    ("expert", "parallelism.expert"), ("nodes_per_replica", "parallelism.nodesPerReplica"),
    ("max_requests", "pool.maxConcurrentRequests"), ("kv_tokens", "pool.kvTokensPerReplica"),
)


def _check_layout(c: _Ctx) -> Iterator[Violation]:
    if c.layout is None:
        yield c.violation("layout-unresolved", "the layout did not resolve to a known model state",
                          "spec.model.layout")


def _check_nested(c: _Ctx) -> Iterator[Violation]:
    """Attention DP and EP nest inside TP; a replica's GPUs split evenly over its nodes; the built-in
    runtime has neither DP nor EP."""
    for role, prefix in _ROLES:
        shape = getattr(c.inp, role, None)
        tp_pp = c.shapes[role]
        par = f"{prefix}.parallelism"
        data, expert = _pos_int(getattr(shape, "data", None)), _pos_int(getattr(shape, "expert", None))
        nodes = _pos_int(getattr(shape, "nodes_per_replica", None))
        if tp_pp is not None:
            tp, pp = tp_pp
            if data and tp % data:
                yield c.violation("attn-dp-divides-tp", f"{role} data {data} does not divide TP {tp}",
                                  f"{par}.data", f"{par}.tensor")
            if expert and tp % expert:
                yield c.violation("ep-divides-tp", f"{role} expert {expert} does not divide TP {tp}",
                                  f"{par}.expert", f"{par}.tensor")
            if nodes and (tp * pp) % nodes:
                yield c.violation("nodes-divide-gpus",
                                  f"{role} nodesPerReplica {nodes} does not divide TP x PP = {tp * pp}",
                                  f"{par}.nodesPerReplica", f"{par}.tensor")
        if c.inp.engine == "pdfleet":
            if data and data > 1:
                yield c.violation("builtin-no-attention-dp", f"{role} data={data} on the built-in runtime",
                                  f"{par}.data", "spec.engine.kind")
            if expert and expert > 1:
                yield c.violation("builtin-no-expert-parallel", f"{role} expert={expert} on the built-in runtime",
                                  f"{par}.expert", "spec.engine.kind")


def _check_tp_pp(c: _Ctx) -> Iterator[Violation]:
    p, d = c.shapes[Role.PREFILL], c.shapes[Role.DECODE]
    if p is None or d is None:
        return
    if p[0] % d[0] and d[0] % p[0]:
        yield c.violation("tp-divisible", f"prefill TP {p[0]} and decode TP {d[0]} do not divide one another",
                          "spec.prefill.parallelism.tensor", "spec.decode.parallelism.tensor")
    if d[1] != p[1] and d[1] != 1:
        yield c.violation("pp-match", f"decode PP {d[1]} is neither the prefill PP {p[1]} nor 1",
                          "spec.decode.parallelism.pipeline", "spec.prefill.parallelism.pipeline")


def _check_layout_shapes(c: _Ctx) -> Iterator[Violation]:
    lay = c.layout
    if lay is None:
        return
    # KV and SWA pages are both sharded by KV head (MLA's latent KV is replicated, and MLA has no SWA)
    mha_kv = ("kv" in lay.state_types and not lay.mla) or "swa" in lay.state_types
    for role, prefix in _ROLES:
        shape = c.shapes[role]
        if shape is None:
            continue
        pp = shape[1]
        if _pos_int(lay.num_layers) and pp > lay.num_layers:
            yield c.violation("pp-layers", f"{role} PP {pp} exceeds the layout's {lay.num_layers} layers",
                              f"{prefix}.parallelism.pipeline", lay.path("num_layers"))
        # heads are sharded over the attention TP (TP / attention DP), so that is the size the rules check
        tp, dp = c.attn_tp(role), c.attn_dp[role]
        what = f"{role} TP {tp}" if dp == 1 else f"{role} attention TP {tp} (TP {shape[0]} / attention DP {dp})"
        paths = (f"{prefix}.parallelism.tensor",) + ((f"{prefix}.parallelism.data",) if dp > 1 else ())
        h = _pos_int(lay.kv_heads)
        if mha_kv and h:
            if h % tp and tp % h:
                yield c.violation("kv-heads-tp", f"{what} and {h} KV heads do not divide one another",
                                  *paths, lay.path("kv_heads"))
            elif tp > h:
                yield c.violation("warn-kv-heads-replicated",
                                  f"{what} > {h} KV heads: each head is stored on {tp // h} ranks",
                                  *paths, lay.path("kv_heads"))
        bad = sorted({n for n in lay.linear_heads if _pos_int(n) and n % tp})
        if bad:
            yield c.violation("linear-heads-tp",
                              f"{what} does not divide linear-attention head counts {bad}",
                              *paths, lay.path("linear_heads"))
        odd = sorted({n for n in lay.conv_group_heads if _pos_int(n) and n % tp and tp % n})
        if odd:
            yield c.violation("conv-groups-tp", f"{what} and conv channel groups of {odd} heads do not divide one "
                              "another", *paths, lay.path("linear_heads"))


def _check_qsa_page(c: _Ctx) -> Iterator[Violation]:
    lay = c.layout
    if lay is None or not (lay.state_types & QSA_STATES):
        return
    ratio, page = _pos_int(lay.qsa_compress_ratio), _pos_int(lay.page_size)
    if ratio and page and page % ratio:
        yield c.violation("qsa-page-ratio",
                          f"page size {page} is not a multiple of the QSA compress ratio {ratio}",
                          lay.path("page_size"), lay.path("qsa_compress_ratio"))


def _check_pools(c: _Ctx) -> Iterator[Violation]:
    lay = c.layout
    if lay is None or lay.pool_bytes is None:
        return
    for role, prefix in _ROLES:
        shape = getattr(c.inp, role, None)
        tp_pp = c.shapes[role]
        if tp_pp is None or not isinstance(shape, RoleInput):
            continue
        reqs, toks, gib = _pos_int(shape.max_requests), _pos_int(shape.kv_tokens), shape.gpu_memory_gib
        if not reqs or not toks or type(gib) not in (int, float) or not math.isfinite(gib) or gib <= 0:
            continue
        # with attention DP each of the dp groups holds its share of the replica's requests and KV tokens,
        # its heads sharded over the attention TP (MLA's latent KV, replicated over TP, shrinks by dp)
        dp = c.attn_dp[role]
        try:
            pools = lay.pool_bytes(c.attn_tp(role), tp_pp[1], -(-reqs // dp), -(-toks // dp))
        except ValueError:  # LayoutError: a shape the layout cannot split; the shape rules say why
            continue
        model = lay.weight_bytes or 0
        weights = -(-model // (tp_pp[0] * tp_pp[1]))
        need = pools + weights
        have = gib * _GIB * c.matrix.gpu_memory_fraction
        if need > have:
            at = f"tp{tp_pp[0]}xpp{tp_pp[1]}" + (f" with attention DP {dp}" if dp > 1 else "")
            what = (f"weights {weights / _GIB:.1f} GiB ({model / _GIB:.1f} GiB / {tp_pp[0] * tp_pp[1]}) "
                    f"and pools {pools / _GIB:.1f} GiB need {need / _GIB:.1f} GiB" if weights
                    else f"pools need {need / _GIB:.1f} GiB")
            yield c.violation(
                "pool-fits-gpu",
                f"{role} {what} per GPU at {at} "
                f"with {toks} KV "
                f"tokens and {reqs} requests; {have / _GIB:.1f} GiB "
                f"({c.matrix.gpu_memory_fraction:.0%} of {gib:g} GiB) is available",
                f"{prefix}.pool.kvTokensPerReplica", f"{prefix}.pool.maxConcurrentRequests",
                f"{prefix}.parallelism.tensor", f"{prefix}.gpuMemoryGiB",
            )


def _check_backend(c: _Ctx) -> Iterator[Violation]:
    b, lay = c.backend, c.layout
    if b is None:
        return
    m = c.matrix

    def no(feature: Feature, message: str, *paths: str) -> Iterator[Violation]:
        cell = m.supports(b, feature)
        if not cell.supported and cell.rule_id:
            yield c.violation(cell.rule_id, message, "spec.transfer.backend", *paths)

    if c.protocol is not None:
        yield from no(_PROTOCOL_FEATURE[c.protocol], f"{b} cannot transfer over {c.protocol}",
                      "spec.transfer.protocol")
    p, d = c.shapes[Role.PREFILL], c.shapes[Role.DECODE]
    if p is None or d is None or lay is None:
        return
    states = lay.state_types
    tp_paths = ("spec.prefill.parallelism.tensor", "spec.decode.parallelism.tensor")
    pp_paths = ("spec.prefill.parallelism.pipeline", "spec.decode.parallelism.pipeline")
    if p[1] > 1 or d[1] > 1:
        yield from no(Feature.PIPELINE, f"{b} cannot pair layers across pipeline stages", *pp_paths)
        if states & QSA_STATES:
            yield from no(Feature.QSA_PIPELINE,
                          f"{b} cannot move QSA state with PP {p[1]}/{d[1]} ({lay.name})", *pp_paths)
    if p[0] != d[0]:
        hetero = f"TP {p[0]} -> {d[0]}"
        if states - QSA_STATES - PLE_STATES - INDEX_STATES:
            yield from no(Feature.SHARDED_HETERO_TP, f"{b} cannot slice sharded state across {hetero}",
                          *tp_paths)
        if states & PLE_STATES:
            yield from no(Feature.REPLICATED_HETERO_TP,
                          f"{b} cannot move replicated PLE state across {hetero} ({lay.name})", *tp_paths)
        if states & INDEX_STATES:
            yield from no(Feature.REPLICATED_HETERO_TP,
                          f"{b} cannot elect writers for replicated index keys across {hetero} ({lay.name})",
                          *tp_paths)
        if any(h < max(p[0], d[0]) for h in lay.conv_group_heads):
            yield from no(Feature.REPLICATED_HETERO_TP,
                          f"{b} cannot elect writers for replicated conv channel groups across {hetero} "
                          f"({lay.name})", *tp_paths)
        if states & QSA_STATES:
            feature = Feature.QSA_HETERO_TP_MLA if lay.mla else Feature.QSA_HETERO_TP_MHA
            kind = "MLA" if lay.mla else "non-MLA"
            yield from no(feature,
                          f"{b} cannot move QSA state across {hetero} on a {kind} model ({lay.name})",
                          *tp_paths)


def _check_runtimes(c: _Ctx, releases: Mapping[str, RuntimeRelease]) -> Iterator[Violation]:
    found: dict[Role, RuntimeRelease] = {}
    for role, prefix in _ROLES:
        version = getattr(getattr(c.inp, role, None), "runtime_version", None)
        rel = release_of(version, releases)
        if rel is None:
            yield c.violation("runtime-version-unknown", f"{role} runtime version {version!r} is unknown",
                              f"{prefix}.runtimeVersion")
        else:
            found[role] = rel
    if len(found) == 2 and not found[Role.PREFILL].wire.talks_to(found[Role.DECODE].wire):
        pr, dr = found[Role.PREFILL], found[Role.DECODE]
        yield c.violation("runtime-protocol-mismatch",
                          f"prefill runtime {pr.version} speaks wire protocol {pr.wire}, decode runtime "
                          f"{dr.version} speaks {dr.wire}",
                          "spec.prefill.runtimeVersion", "spec.decode.runtimeVersion")


def _check_warnings(c: _Ctx) -> Iterator[Violation]:
    if c.protocol is LinkProtocol.TCP:
        yield c.violation("warn-tcp-transfer", "transfer runs over TCP", "spec.transfer.protocol")
    if c.protocol in (LinkProtocol.NVLINK, LinkProtocol.SHM):
        yield c.violation("warn-same-node-protocol", f"{c.protocol} reaches one host only",
                          "spec.transfer.protocol")
    if c.backend is Backend.MORI:
        yield c.violation("warn-mori-rocm", "mori needs ROCm on the nodes", "spec.transfer.backend")


CHECKS: tuple[tuple[frozenset[str], Check], ...] = (
    (frozenset({"input-invalid"}), _check_inputs),
    (frozenset({"layout-unresolved"}), _check_layout),
    (frozenset({"attn-dp-divides-tp", "ep-divides-tp", "nodes-divide-gpus",
                "builtin-no-attention-dp", "builtin-no-expert-parallel"}), _check_nested),
    (frozenset({"tp-divisible", "pp-match"}), _check_tp_pp),
    (frozenset({"pp-layers", "kv-heads-tp", "linear-heads-tp", "conv-groups-tp", "warn-kv-heads-replicated"}),
     _check_layout_shapes),
    (frozenset({"qsa-page-ratio"}), _check_qsa_page),
    (frozenset({"pool-fits-gpu"}), _check_pools),
    (frozenset({"warn-tcp-transfer", "warn-same-node-protocol", "warn-mori-rocm"}), _check_warnings),
)


def _matrices_for(inp: MatrixInput, releases: Mapping[str, RuntimeRelease]) -> list[Matrix]:
    versions = []
    for role, _ in _ROLES:
        rel = release_of(getattr(getattr(inp, role, None), "runtime_version", None), releases)
        if rel is not None and rel.matrix_version in MATRICES and rel.matrix_version not in versions:
            versions.append(rel.matrix_version)
    return [MATRICES[v] for v in versions] or [MATRICES[LATEST_MATRIX_VERSION]]


def _run(c: _Ctx, check: Callable[[_Ctx], Iterable[Violation]], name: str) -> list[Violation]:
    try:
        return list(check(c))
    except Exception as exc:  # totality: a bug in one rule must not hide the others or crash admission
        return [c.violation("matrix-internal-error", f"rule group {name} failed: {type(exc).__name__}: {exc}",
                            "spec")]


def evaluate(
    inp: MatrixInput,
    matrix: Matrix | None = None,
    releases: Mapping[str, RuntimeRelease] = RUNTIME_RELEASES,
    only: str | None = None,
) -> Verdict:
    """Every violation and warning of ``inp``; never raises.

    ``matrix`` pins one version (the running operator's, for re-checking stored objects); by default
    each role's runtime release picks its matrix and a spec must pass all of them. ``only`` runs a
    single rule (tests use it to show rules are independent).
    """
    matrices = [matrix] if matrix is not None else _matrices_for(inp, releases)
    seen: set[tuple[str, tuple[str, ...]]] = set()
    errors: list[Violation] = []
    warnings: list[Violation] = []
    for i, m in enumerate(matrices):
        c = _Ctx(inp, m)
        found: list[Violation] = []
        for rule_ids, check in CHECKS:
            if only is None or only in rule_ids:
                found += _run(c, check, check.__name__)
        if only is None or "." in only:
            found += _run(c, _check_backend, "backend")
        if i == 0 and (only is None or only.startswith("runtime-")):
            found += _run(c, lambda ctx: _check_runtimes(ctx, releases), "runtimes")
        for v in found:
            key = (v.rule, v.paths)
            if (only is not None and v.rule != only) or key in seen:
                continue
            seen.add(key)
            (warnings if v.severity is Severity.WARNING else errors).append(v)
    return Verdict(tuple(errors), tuple(warnings), tuple(m.version for m in matrices))


def evaluate_rule(rule_id: str, inp: MatrixInput, matrix: Matrix | None = None) -> tuple[Violation, ...]:
    """The violations (or warnings) of one rule alone."""
    v = evaluate(inp, matrix, only=rule_id)
    return v.violations + v.warnings


# -- from a layout to the facts the matrix reads -----------------------------------------------------

_PRESET_FACTS: dict[str, LayoutFacts] = {}


def _pool_bytes_fn(layout: Layout) -> Callable[[int, int, int, int], int]:
    """Per-rank pool bytes of the deepest-loaded PP stage, as ``layouts.rank_state_bytes`` counts them.

    Item bytes per index kind depend only on (tp, pp, stage); they are computed once per shape and
    multiplied by the capacity's item counts, so a re-evaluation costs a few multiplications.
    """
    per_shape: dict[tuple[int, int], list[dict[IndexKind, int]]] = {}

    def pool_bytes(tp: int, pp: int, max_requests: int, kv_tokens: int) -> int:
        stages = per_shape.get((tp, pp))
        if stages is None:
            stages = [item_bytes_by_kind(layout, tp, pp, stage) for stage in range(pp)]
            if len(per_shape) < 256:
                per_shape[(tp, pp)] = stages
        counts = pool_counts(layout, max_requests, kv_tokens)
        return max(sum(b * counts[k] for k, b in s.items()) for s in stages)

    return pool_bytes


def layout_facts(ref: LayoutRef | Layout | str, base: str = "spec.model.layout") -> LayoutFacts:
    """The matrix's view of a layout reference; raises ``LayoutError`` when it does not resolve.

    Facts of a preset point at ``{base}.preset``; those of an inline layout at the inline field.
    Preset facts are cached (presets are immutable).
    """
    preset = ref if isinstance(ref, str) else ref.preset if isinstance(ref, LayoutRef) else None
    if preset is not None and preset in _PRESET_FACTS and base == "spec.model.layout":
        return _PRESET_FACTS[preset]
    layout = resolve_layout(ref)
    la = layout.linear_attention
    if preset is not None:
        paths = dict.fromkeys(("num_layers", "kv_heads", "page_size", "linear_heads", "qsa_compress_ratio"),
                              f"{base}.preset")
    else:
        inline = f"{base}.inline"
        paths = {"num_layers": f"{inline}.numLayers", "kv_heads": f"{inline}.kvHeads",
                 "page_size": f"{inline}.pageSize", "linear_heads": f"{inline}.linearAttention",
                 "qsa_compress_ratio": f"{inline}.qsa.compressRatio"}
    facts = LayoutFacts(
        name=preset or "inline",
        num_layers=layout.num_layers,
        state_types=frozenset(str(s) for s in layout.state_types()),
        mla=layout.attention_kind is AttentionKind.MLA,
        kv_heads=layout.kv_heads,
        page_size=layout.page_size,
        linear_heads=(
            () if la is None or not layout.linear_layer_ids
            else (la.num_value_heads,) if la.conv_groups is not None else (la.num_key_heads, la.num_value_heads)
        ),
        conv_group_heads=(tuple(g.heads for g in la.conv_groups)
                          if la is not None and la.conv_groups is not None and layout.linear_layer_ids else ()),
        qsa_compress_ratio=layout.qsa_compress_ratio,
        pool_bytes=_pool_bytes_fn(layout),
        paths=MappingProxyType(paths),
        weight_bytes=PRESET_WEIGHT_BYTES.get(preset) if preset is not None else layout.weight_bytes,
    )
    if preset is not None and base == "spec.model.layout":
        _PRESET_FACTS[preset] = facts
    return facts


def matrix_input(layout: LayoutRef | Layout | str, backend: Backend | str, protocol: LinkProtocol | str,
                 prefill: RoleInput, decode: RoleInput, engine: str = "pdfleet", *,
                 count_weights: bool = True) -> MatrixInput:
    """The one builder of an evaluation's input (the operator's admission and the parity harness):
    the layout's facts, None when it does not resolve (the matrix then says ``layout-unresolved``).
    ``count_weights=False`` leaves the model's weights out of the GPU memory rule (the byte-parity harness
    fills seeded pools and loads no weights)."""
    try:
        facts: LayoutFacts | None = layout_facts(layout)
    except (LayoutError, ValueError):
        facts = None
    if facts is not None and not count_weights and facts.weight_bytes is not None:
        facts = replace(facts, weight_bytes=None)
    return MatrixInput(facts, backend, protocol, prefill, decode, engine)

"""What a token-parity run is asked (``ModelParityConfig``) and answers (``ModelParityResult``, per ``ModelCase``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pdfleet_runtime.model.state import ModelFault
from pdfleet_runtime.records import ParallelShape

from .results import Rejection

__all__ = ["FP32_LOGIT_BOUND", "ModelCase", "ModelParityConfig", "ModelParityResult"]

FP32_LOGIT_BOUND = 1e-3
"""Largest |logit difference| between PD and aggregate accepted for a float32 model."""
_BOUNDS = {"float32": FP32_LOGIT_BOUND, "bfloat16": 0.25, "float16": 0.05}


@dataclass(frozen=True)
class ModelParityConfig:
    model_dir: Path
    prompts: tuple[tuple[int, ...], ...]
    max_new_tokens: int
    prefill: ParallelShape
    decode: ParallelShape
    backend: str = "local"
    device: str = "cpu"
    protocol: str = "tcp"
    seed: int = 7
    """Seeds the pools' fragmented allocation (and a model without weights is drawn from ``init_seed``)."""
    preset: str | None = None
    """A layout preset named beside the model: it must agree with config.json."""
    page_size: int | None = None
    init_seed: int = 0
    init_range: float | None = None
    fault: ModelFault | None = None
    group_nodes: tuple[int, int] = (1, 1)
    """Pods per replica (prefill, decode): a replica spread over several pods (engine backends only)."""

    def bound(self, dtype: str) -> float:
        """The logit bound for the model's dtype (fp32: ``FP32_LOGIT_BOUND``)."""
        return _BOUNDS[dtype]


@dataclass(frozen=True)
class ModelCase:
    """One prompt through PD and through aggregate."""

    name: str
    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    """PD's token ids, the prefill's first token first."""
    aggregate: tuple[int, ...]
    max_logit_diff: float
    """Over the steps the decode computed (the first token's logits stay on the prefill), against the same forward
    calls continuing with the model's own cache (``ModelRunner.forward_reference``)."""
    bound: float
    error: str = ""
    reference: tuple[int, ...] = ()
    """The forward reference's token ids (must equal ``aggregate``, transformers' ``generate``)."""
    generate_logit_diff: float = 0.0
    """The same steps against ``generate``'s logits: reported, not bounded (see ``forward_reference``)."""
    """A failure before tokens could be compared (a transfer failed, no first token carried, shares unusable)."""
    bytes_moved: int = 0
    bytes_by_state: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def first_difference(self) -> int | None:
        for i, (a, b) in enumerate(zip(self.tokens, self.aggregate, strict=False)):
            if a != b:
                return i
        return None if len(self.tokens) == len(self.aggregate) else min(len(self.tokens), len(self.aggregate))

    @property
    def ok(self) -> bool:
        return (not self.error and self.tokens == self.aggregate and (not self.reference or self.reference == self.aggregate)
                and self.max_logit_diff <= self.bound)

    def describe(self) -> str:
        if self.error:
            return f"case {self.name}: {self.error}"
        if self.tokens != self.aggregate:
            i = self.first_difference
            return (f"case {self.name}: token {i} differs (PD {list(self.tokens)}, aggregate {list(self.aggregate)})")
        if self.reference and self.reference != self.aggregate:
            return (f"case {self.name}: the forward reference {list(self.reference)} differs from generate "
                    f"{list(self.aggregate)}: the logits reference is unusable")
        if self.max_logit_diff > self.bound:
            return f"case {self.name}: max |logit diff| {self.max_logit_diff:.3g} above {self.bound:g}"
        return f"case {self.name}: token-exact, max |logit diff| {self.max_logit_diff:.3g}"

    def as_json(self) -> dict[str, object]:
        return {"case": self.name, "ok": self.ok, "prompt_ids": list(self.prompt), "tokens": list(self.tokens),
                "aggregate_ids": list(self.aggregate), "first_difference": self.first_difference,
                "max_logit_diff": self.max_logit_diff, "reference_ids": list(self.reference),
                "generate_logit_diff": self.generate_logit_diff, "error": self.error or None, "bytes_moved": self.bytes_moved,
                "bytes_by_state": self.bytes_by_state, "seconds": {k: round(v, 4) for k, v in self.seconds.items()}}


@dataclass
class ModelParityResult:
    ok: bool
    cases: list[ModelCase] = field(default_factory=list)
    rejection: Rejection | None = None
    model_type: str = ""
    dtype: str = ""
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def max_logit_diff(self) -> float:
        return max((c.max_logit_diff for c in self.cases), default=0.0)

    def failures(self) -> list[str]:
        return [c.describe() for c in self.cases if not c.ok]

    def as_json(self, cfg: ModelParityConfig) -> dict[str, object]:
        return {
            "ok": self.ok, "model": str(cfg.model_dir), "model_type": self.model_type, "dtype": self.dtype,
            "prefill": str(cfg.prefill), "decode": str(cfg.decode), "backend": cfg.backend, "device": cfg.device,
            "protocol": cfg.protocol, "fault": cfg.fault.value if cfg.fault else None,
            "max_new_tokens": cfg.max_new_tokens, "logit_bound": cfg.bound(self.dtype) if self.dtype else None,
            "max_logit_diff": self.max_logit_diff, "cases": [c.as_json() for c in self.cases],
            "failures": self.failures(), "seconds": {k: round(v, 4) for k, v in self.seconds.items()},
            "rejected": None if self.rejection is None else {
                "rule": self.rejection.rule, "message": self.rejection.message, "reason": self.rejection.reason},
        }

"""What the engine says about itself, read as SGLang 0.5.23 writes it (pure).

- ``GET /server_info`` (``python/sglang/srt/entrypoints/http_server.py`` ``server_info``): the resolved
  ServerArgs (``served_model_name``, ``model_path``, ``disaggregation_mode``, ``tp_size``, ...), the
  scheduler info, ``internal_states`` and ``version`` (SGLang's ``__version__``);
- ``GET /model_info`` (the same file, ``model_info``): ``model_path``, ``served_model_name``,
  ``is_generation``, ``disaggregation_mode``, ``model_type``, ``architectures``;
- ``GET /metrics`` (``python/sglang/srt/observability/metrics_collector.py``): gauges per scheduler
  (labels ``model_name``, ``engine_type``, ``tp_rank``, ``pp_rank``, ...; a ``priority`` label holds
  per-priority breakdowns, the total under ``priority=""``). The drain reads ``sglang:num_running_reqs``,
  ``sglang:num_queue_reqs`` and, on prefill pods, ``sglang:num_prefill_inflight_queue_reqs`` (requests
  whose KV is being sent); the built-in runtime exports the same names (``pod.metrics``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from pdfleet_runtime.pod.metrics import SGLANG_INFLIGHT, SGLANG_QUEUED, SGLANG_RUNNING

__all__ = ["EngineLoad", "engine_load", "server_info_problems"]


def server_info_problems(info: dict[str, Any], *, version: str, served_model: str, role: str) -> list[str]:
    """Each way ``/server_info`` contradicts what the deployment declares, as a sentence; [] when none."""
    out = []
    got = info.get("version")
    if got != version:
        out.append(f"the engine reports version {got!r}, the deployment declares {version!r} "
                   "(spec.engine.version or the role's engine.version)")
    names = info.get("served_model_name")
    if names != served_model and not (isinstance(names, list) and served_model in names):
        out.append(f"the engine serves model {names!r}, the deployment declares {served_model!r} "
                   "(spec.model.servedName, else the deployment's name)")
    mode = info.get("disaggregation_mode")
    if mode != role:
        out.append(f"the engine runs disaggregation_mode {mode!r}, this pod's role is {role!r}")
    return out


@dataclass(frozen=True)
class EngineLoad:
    """Requests the engine holds, summed over its schedulers (every tp/pp/dp rank reports its own)."""

    running: int
    queued: int
    inflight: int
    """Prefill: requests whose KV is still being sent (SGLang's inflight queue)."""

    @property
    def idle(self) -> bool:
        return self.running == 0 and self.queued == 0 and self.inflight == 0


def engine_load(text: str, model: str | None = None) -> EngineLoad:
    """The engine's load from its ``/metrics`` body; ``ValueError`` when it has no running/queue gauge
    (``--enable-metrics`` missing, or not SGLang's names), since a drain must never guess zero."""
    totals: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name not in (SGLANG_RUNNING, SGLANG_QUEUED, SGLANG_INFLIGHT):
            continue
        for s in fam.samples:
            if s.labels.get("priority", ""):  # a per-priority breakdown of the total
                continue
            if model is not None and s.labels.get("model_name", model) != model:
                continue
            totals[fam.name] = totals.get(fam.name, 0.0) + s.value
    missing = [n for n in (SGLANG_RUNNING, SGLANG_QUEUED) if n not in totals]
    if missing:
        raise ValueError(f"the engine's /metrics has no {', '.join(missing)} (is it started with --enable-metrics?)")
    return EngineLoad(int(totals[SGLANG_RUNNING]), int(totals[SGLANG_QUEUED]), int(totals.get(SGLANG_INFLIGHT, 0)))

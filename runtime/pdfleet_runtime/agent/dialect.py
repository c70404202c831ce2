"""What differs between engines for the agent: where the engine says who it is, the names its load is
exported under, and how its router sends a request (the canary). One dialect per engine kind; the agent's
loops, readiness and drain are the same for all.

- SGLang 0.5.23: ``/server_info`` (version, served model, disaggregation mode), ``sglang:*`` gauges, the
  canary as sglang-router sends a request (``canary.py``);
- vLLM 0.33: ``/version`` and ``/v1/models``, ``vllm:*`` gauges, the canary as vllm-router sends a request over
  the deployment's connector, NIXL or Mooncake (``vllm_engine.py``).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

from pdfleet_runtime.agent import vllm_engine
from pdfleet_runtime.agent.canary import CanaryOutcome, PrefillTarget, run_canary
from pdfleet_runtime.agent.engine_info import EngineLoad, engine_load, server_info_problems
from pdfleet_runtime.links import Backend

__all__ = ["ENGINE_KINDS", "EngineDialect", "Getter", "SGLangDialect", "VllmDialect", "dialect_for"]

Getter = Callable[[str], Awaitable[tuple[int, str]]]
"""GET a path of the engine's HTTP port: its status and body text."""

ENGINE_KINDS = ("sglang", "vllm")


class EngineDialect(Protocol):
    @property
    def name(self) -> str:
        """The engine as logs and reasons name it."""
        ...

    @property
    def router(self) -> str:
        """The router whose requests the canary imitates."""
        ...

    async def problems(self, get: Getter, *, version: str, served_model: str, role: str) -> list[str]:
        """Each way the engine's own account of itself contradicts the deployment; [] when none."""
        ...

    def load(self, metrics_text: str) -> EngineLoad: ...

    async def canary(self, session: aiohttp.ClientSession, target: PrefillTarget, engine_url: str,
                     timeout_s: float) -> CanaryOutcome: ...


async def _json(get: Getter, path: str) -> Any:
    code, text = await get(path)
    if code != 200:
        raise ValueError(f"the engine's {path} answered {code}")
    return json.loads(text)


@dataclass(frozen=True)
class SGLangDialect:
    name: str = "SGLang"
    router: str = "SGLang's router"

    async def problems(self, get: Getter, *, version: str, served_model: str, role: str) -> list[str]:
        info = await _json(get, "/server_info")
        if not isinstance(info, dict):
            return ["the engine's /server_info is not an object"]
        return server_info_problems(info, version=version, served_model=served_model, role=role)

    def load(self, metrics_text: str) -> EngineLoad:
        return engine_load(metrics_text)

    async def canary(self, session: aiohttp.ClientSession, target: PrefillTarget, engine_url: str,
                     timeout_s: float) -> CanaryOutcome:
        return await run_canary(session, target, engine_url, timeout_s)


@dataclass(frozen=True)
class VllmDialect:
    served_model: str
    nixl: bool
    """The deployment's connector: NIXL (two steps) or Mooncake (one step through a transfer id)."""
    name: str = "vLLM"
    router: str = "vllm-router"

    async def problems(self, get: Getter, *, version: str, served_model: str, role: str) -> list[str]:
        return vllm_engine.info_problems(await _json(get, "/version"), await _json(get, "/v1/models"),
                                         declared_version=version, served_model=served_model)

    def load(self, metrics_text: str) -> EngineLoad:
        return vllm_engine.vllm_load(metrics_text)

    async def canary(self, session: aiohttp.ClientSession, target: PrefillTarget, engine_url: str,
                     timeout_s: float) -> CanaryOutcome:
        return await vllm_engine.run_vllm_canary(session, target, engine_url, timeout_s, model=self.served_model,
                                                 nixl=self.nixl)


def dialect_for(kind: str, backend: Backend, served_model: str) -> EngineDialect:
    """The dialect of ``kind`` (``spec.engine.kind``); ``ValueError`` naming the kinds the agent knows, and a
    vLLM deployment's backend when vLLM has no PD connector the agent drives for it (MORI)."""
    if kind == "sglang":
        return SGLangDialect()
    if kind == "vllm":
        if backend not in (Backend.NIXL, Backend.MOONCAKE):
            raise ValueError(f"the agent drives vLLM's NIXL and Mooncake connectors, not {backend.value}")
        return VllmDialect(served_model=served_model, nixl=backend is Backend.NIXL)
    raise ValueError(f"--engine-kind {kind!r}: the agent runs beside {' or '.join(ENGINE_KINDS)}")

"""What the agent reads from a vLLM 0.33 engine, and its canary as vllm-router sends a request (pure but the
canary's HTTP).

- ``GET /version`` (``entrypoints/serve/instrumentator/basic.py``): ``{"version": VLLM_VERSION}``;
- ``GET /v1/models`` (``entrypoints/serve/engine/protocol.py`` ``ModelList``): each served name as a card's
  ``id``, the model path as its ``root``. vLLM tells its KV role only in dev mode (``/server_info``), so the
  role is proven by the canary instead: a decode that is not ``kv_consumer`` fails it;
- ``GET /metrics``: ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and
  ``vllm:kv_cache_usage_perc`` (labels ``model_name``, ``engine``). A prefill keeps a finished request's blocks
  until its decode read them or ``kv_lease_duration`` ran out (NIXL's ``pull_scheduler.py``): they are not free,
  so a prefill whose KV usage is above zero still has state to hand over, and its drain waits for it.

The canary (docs/vllm.md, ../shared/vllm.md "Router protocol"): NIXL in two steps (the prefill gets the prompt
with ``max_tokens: 1`` and ``kv_transfer_params: {do_remote_decode: true, ...}``; its answer's
``kv_transfer_params`` go verbatim to this pod's engine with the request); Mooncake in one step with a
``transfer_id`` the canary makes, the decode told ``remote_bootstrap_addr`` and the engine id the prefill's
bootstrap ``GET /query`` answers. When the engine is the built-in runtime standing in for vLLM (its answer
carries ``pdfleet``), the completion is derived again from the verified state, as the SGLang canary does.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from pdfleet_runtime.agent.canary import (
    CANARY_MAX_TOKENS,
    CANARY_PROMPT,
    CanaryOutcome,
    PrefillTarget,
    post_json,
)
from pdfleet_runtime.agent.engine_info import EngineLoad
from pdfleet_runtime.pod.metrics import VLLM_KV_USAGE, VLLM_RUNNING, VLLM_WAITING
from pdfleet_runtime.pod.vllm_contract import room_of_transfer
from pdfleet_runtime.pod.worker_api import Endpoint, completion, parse_request

__all__ = ["NIXL_STEP_ONE", "canary_request", "check_vllm_answers", "info_problems", "mooncake_bodies", "nixl_bodies",
           "run_vllm_canary", "vllm_load"]

NIXL_STEP_ONE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}
"""The prefill's ``kv_transfer_params`` in NIXL's first step, exactly as vllm-router 0.1.17 sends them."""


def info_problems(version: Any, models: Any, *, declared_version: str, served_model: str) -> list[str]:
    """Each way ``/version`` and ``/v1/models`` contradict the deployment, as a sentence; [] when none."""
    out = []
    got = version.get("version") if isinstance(version, dict) else None
    if got != declared_version:
        out.append(f"the engine reports version {got!r}, the deployment declares {declared_version!r} "
                   "(spec.engine.version or the role's engine.version)")
    data = models.get("data") if isinstance(models, dict) else None
    names = [m.get("id") for m in data if isinstance(m, dict)] if isinstance(data, list) else []
    if served_model not in names:
        out.append(f"the engine serves models {names!r}, the deployment declares {served_model!r} "
                   "(spec.model.servedName, else the deployment's name; vLLM's --served-model-name)")
    return out


def vllm_load(text: str, model: str | None = None) -> EngineLoad:
    """The engine's load from vLLM's ``/metrics`` body; ``ValueError`` when the running or waiting gauge is
    missing (not vLLM's names), since a drain must never guess zero. ``inflight``: 1 while the KV cache holds
    blocks (a prefill's finished requests wait there for their decodes)."""
    totals: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name not in (VLLM_RUNNING, VLLM_WAITING, VLLM_KV_USAGE):
            continue
        for s in fam.samples:
            if model is not None and s.labels.get("model_name", model) != model:
                continue
            totals[fam.name] = totals.get(fam.name, 0.0) + s.value
    missing = [n for n in (VLLM_RUNNING, VLLM_WAITING) if n not in totals]
    if missing:
        raise ValueError(f"the engine's /metrics has no {', '.join(missing)} (is it vLLM's API server?)")
    return EngineLoad(int(totals[VLLM_RUNNING]), int(totals[VLLM_WAITING]), int(totals.get(VLLM_KV_USAGE, 0.0) > 0))


def canary_request(model: str) -> dict[str, Any]:
    """The canary's completion request, as a client sends it to vllm-router."""
    return {"model": model, "prompt": CANARY_PROMPT, "max_tokens": CANARY_MAX_TOKENS, "temperature": 0.0,
            "stream": False}


def nixl_bodies(body: dict[str, Any], params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """NIXL's two steps: the prefill's body, and the decode's with the prefill's answered ``params``."""
    return {**body, "max_tokens": 1, "kv_transfer_params": NIXL_STEP_ONE}, {**body, "kv_transfer_params": params}


def mooncake_bodies(body: dict[str, Any], transfer: str, engine: str,
                    bootstrap: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Mooncake's one step: the prefill's and the decode's bodies for the router-made ``transfer`` id."""
    return ({**body, "kv_transfer_params": {"do_remote_decode": True, "transfer_id": transfer}},
            {**body, "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": transfer,
                                            "remote_engine_id": engine, "remote_bootstrap_addr": bootstrap}})


def check_vllm_answers(body: dict[str, Any], prefill: tuple[int, Any], decode: tuple[int, Any],
                       *, nixl: bool, room: int | None = None) -> str | None:
    """What is wrong with the prefill's and this pod's answers to ``body``; None when the canary passed.
    ``room``: the room the built-in runtime derives from the request's transfer (its answer must name it)."""
    (pcode, pans), (dcode, dans) = prefill, decode
    if pcode != 200:
        return f"the prefill pod answered {pcode}: {str(pans)[:300]}"
    if nixl and not (isinstance(pans, dict) and isinstance(pans.get("kv_transfer_params"), dict)):
        return ("the prefill pod's answer has no kv_transfer_params: is its engine started with "
                f"--kv-transfer-config '{{\"kv_role\": \"kv_producer\", ...}}'? {str(pans)[:200]}")
    if dcode != 200:
        return f"this pod's engine answered {dcode}: {str(dans)[:300]}"
    choices = dans.get("choices") if isinstance(dans, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return f"this pod's engine answered outside OpenAI's completion shape: {str(dans)[:300]}"
    usage = dans.get("usage") if isinstance(dans.get("usage"), dict) else {}
    n = usage.get("completion_tokens")
    if (not isinstance(choices[0].get("text"), str) or not isinstance(n, int) or n < 1
            or choices[0].get("finish_reason") is None):
        return f"the answer has no completion (completion_tokens={n!r}, finish_reason={choices[0].get('finish_reason')!r})"
    pdf = dans.get("pdfleet")
    if isinstance(pdf, dict):  # the built-in runtime standing in for vLLM: the state must have arrived whole
        moved, whole = pdf.get("transferBytes"), pdf.get("layoutBytes")
        if pdf.get("recomputed") or not isinstance(moved, int) or moved <= 0 or moved != whole:
            return f"the stand-in moved {moved!r} of {whole!r} bytes (recomputed: {pdf.get('recomputed')})"
        if pdf.get("room") != room:
            return f"the stand-in answered for room {pdf.get('room')!r}, the canary's transfer names room {room!r}"
        if pdf.get("state") != "model":  # seeded: the verified bytes decide the tokens
            req = parse_request(Endpoint.COMPLETIONS, json.dumps(body).encode()).model_copy(update={"room": room})
            want = completion(req.seed, req.prompt_tokens, moved, req.max_tokens)
            if not pdf.get("verified") or choices[0]["text"] != want.text:
                return f"the completion is not the one the verified state derives ({choices[0]['text']!r})"
    return None


async def _engine_id(session: aiohttp.ClientSession, target: PrefillTarget) -> str:
    """The prefill's engine id as its Mooncake bootstrap answers ``GET /query`` (data-parallel rank 0)."""
    async with session.get(f"http://{target.host}:{target.bootstrap_port}/query") as resp:
        answer = json.loads(await resp.text())
    engine = answer.get("0", {}).get("engine_id") if isinstance(answer, dict) else None
    if not isinstance(engine, str):
        raise ValueError(f"the prefill's bootstrap /query names no engine id: {str(answer)[:200]}")
    return engine


async def _prefill_step(session: aiohttp.ClientSession, target: PrefillTarget, body: dict[str, Any],
                        nixl: bool) -> tuple[tuple[int, Any], dict[str, Any] | None, str]:
    """The prefill's step: its answer, the body this pod's engine gets next (None: the step failed), the
    request's label (NIXL: the prefill's ``remote_request_id``; Mooncake: the canary's ``transfer_id``)."""
    if nixl:
        first, _ = nixl_bodies(body, {})
        answer = await post_json(session, f"{target.url}/v1/completions", first)
        params = answer[1].get("kv_transfer_params") if isinstance(answer[1], dict) else None
        if answer[0] != 200 or not isinstance(params, dict):
            return answer, None, "-"
        return answer, nixl_bodies(body, params)[1], str(params.get("remote_request_id"))
    engine = await _engine_id(session, target)
    transfer = f"pdfleet-canary-{secrets.token_hex(8)}"
    first, then = mooncake_bodies(body, transfer, engine, f"http://{target.host}:{target.bootstrap_port}")
    answer = await post_json(session, f"{target.url}/v1/completions", first)
    return answer, then if answer[0] == 200 else None, transfer


async def run_vllm_canary(session: aiohttp.ClientSession, target: PrefillTarget, engine_url: str,
                          timeout_s: float, *, model: str, nixl: bool) -> CanaryOutcome:
    """One canary through ``target`` and this pod's engine at ``engine_url``, as vllm-router sends it."""
    body = canary_request(model)
    tag = "NIXL" if nixl else "Mooncake"
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            try:
                prefill, next_body, label = await _prefill_step(session, target, body, nixl)
            except (aiohttp.ClientError, OSError, ValueError) as e:
                return CanaryOutcome(False, f"cannot reach prefill pod {target}: {e!r}", time.monotonic() - t0,
                                     unreachable=True)
            decode: tuple[int, Any] = (0, "not sent: the prefill's step failed")
            if next_body is not None:
                try:
                    decode = await post_json(session, f"{engine_url}/v1/completions", next_body)
                except (aiohttp.ClientError, OSError) as e:
                    return CanaryOutcome(False, f"cannot reach this pod's engine: {e!r}", time.monotonic() - t0)
    except TimeoutError:
        return CanaryOutcome(False, f"no answer within {timeout_s:g}s ({tag})", time.monotonic() - t0)
    seconds = time.monotonic() - t0
    room = (room_of_transfer(label) if not nixl else int(label) if label.isdigit() and int(label) < 2**63 else None)
    problem = check_vllm_answers(body, prefill, decode, nixl=nixl, room=room)
    if problem is not None:
        return CanaryOutcome(False, f"{tag} request {label} via prefill pod {target}: {problem}", seconds)
    return CanaryOutcome(True, f"{tag} request {label} via prefill pod {target} answered in {seconds:.3f}s", seconds)

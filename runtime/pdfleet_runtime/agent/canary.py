"""The decode pod's canary, sent exactly as SGLang's router sends a request, and its answer re-checked.

SGLang's router (sglang-router 0.3.2) posts one body to a prefill worker and a decode worker at once,
with ``bootstrap_host`` (the prefill pod), ``bootstrap_port`` and a random ``bootstrap_room`` added, and
returns the decode's answer. The canary does the same with a short ``/generate`` request to one
prefill pod and to this pod's own engine, so the KV of a real request crossed the transfer path when
it passes. Its answer is re-checked: both sides 200, the decode's answer in SGLang's ``/generate``
shape (``text``, ``output_ids``, ``meta_info`` with ``completion_tokens`` >= 1 and a
``finish_reason``); and when the engine is the built-in runtime standing in for SGLang (its answer
carries ``pdfleet``), the completion is derived again from the request, as the built-in runtime's
own clients check it (``pod.worker_api``): the bytes it verified decide the tokens.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from pdfleet_runtime.pod.worker_api import Endpoint, completion, parse_request

__all__ = ["CANARY_PROMPT", "CanaryOutcome", "PrefillTarget", "canary_body", "check_answers", "post_json", "run_canary"]

CANARY_PROMPT = "pdfleet canary: the transfer path of this decode pod"
CANARY_MAX_TOKENS = 4


@dataclass(frozen=True)
class PrefillTarget:
    """One prefill pod as the router sees it: its engine's HTTP URL and its bootstrap address."""

    host: str
    http_port: int
    bootstrap_port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    def __str__(self) -> str:
        return f"{self.host}:{self.http_port}"


@dataclass(frozen=True)
class CanaryOutcome:
    ok: bool
    reason: str
    seconds: float
    unreachable: bool = False
    """The prefill pod could not be reached at all (no verdict on this pod's own path)."""


def canary_body(target: PrefillTarget, room: int) -> dict[str, Any]:
    return {"text": CANARY_PROMPT, "sampling_params": {"max_new_tokens": CANARY_MAX_TOKENS, "temperature": 0.0},
            "stream": False, "bootstrap_host": target.host, "bootstrap_port": target.bootstrap_port,
            "bootstrap_room": room, "rid": f"pdfleet-canary-{room}"}


def check_answers(body: dict[str, Any], prefill: tuple[int, Any], decode: tuple[int, Any]) -> str | None:
    """What is wrong with the two answers to ``body``; None when the canary passed."""
    (pcode, pans), (dcode, dans) = prefill, decode
    if pcode != 200:
        return f"the prefill pod answered {pcode}: {str(pans)[:300]}"
    if dcode != 200:
        return f"this pod's engine answered {dcode}: {str(dans)[:300]}"
    if not isinstance(dans, dict) or not isinstance(dans.get("meta_info"), dict):
        return f"this pod's engine answered outside SGLang's /generate shape: {str(dans)[:300]}"
    meta = dans["meta_info"]
    n = meta.get("completion_tokens")
    if not isinstance(dans.get("text"), str) or not isinstance(n, int) or n < 1 or meta.get("finish_reason") is None:
        return f"the answer has no completion (completion_tokens={n!r}, finish_reason={meta.get('finish_reason')!r})"
    pdf = dans.get("pdfleet")
    if isinstance(pdf, dict):  # the built-in runtime standing in for SGLang: derive its completion again
        req = parse_request(Endpoint.GENERATE, json.dumps(body).encode())
        if not pdf.get("verified") or pdf.get("room") != body["bootstrap_room"]:
            return f"the stand-in did not verify room {body['bootstrap_room']}: {pdf}"
        want = completion(req.seed, req.prompt_tokens, int(pdf.get("transferBytes", -1)), req.max_tokens)
        if dans.get("output_ids") != list(want.ids):
            return (f"the completion is not the one the verified state of room {body['bootstrap_room']} derives "
                    f"({dans.get('output_ids')} != {list(want.ids)})")
    return None


async def post_json(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with session.post(url, json=body) as resp:
        text = await resp.text()
        try:
            return resp.status, json.loads(text)
        except ValueError:
            return resp.status, text


async def run_canary(session: aiohttp.ClientSession, target: PrefillTarget, engine_url: str,
                     timeout_s: float) -> CanaryOutcome:
    """One canary through ``target`` and this pod's engine at ``engine_url``."""
    room = secrets.randbits(63)
    body = canary_body(target, room)
    t0 = time.monotonic()
    prefill: tuple[int, Any] | BaseException
    decode: tuple[int, Any] | BaseException
    try:
        async with asyncio.timeout(timeout_s):
            prefill, decode = await asyncio.gather(post_json(session, f"{target.url}/generate", body),
                                                   post_json(session, f"{engine_url}/generate", body),
                                                   return_exceptions=True)
    except TimeoutError:
        return CanaryOutcome(False, f"no answer within {timeout_s:g}s (room {room})", time.monotonic() - t0)
    seconds = time.monotonic() - t0
    if isinstance(prefill, BaseException):
        return CanaryOutcome(False, f"cannot reach prefill pod {target}: {prefill!r}", seconds, unreachable=True)
    if isinstance(decode, BaseException):
        return CanaryOutcome(False, f"cannot reach this pod's engine: {decode!r}", seconds)
    problem = check_answers(body, prefill, decode)
    if problem is not None:
        return CanaryOutcome(False, f"room {room} via prefill pod {target}: {problem}", seconds)
    return CanaryOutcome(True, f"room {room} via prefill pod {target} answered in {seconds:.3f}s", seconds)

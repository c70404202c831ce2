"""Client traffic for the end-to-end tests and the benchmarks: a bounded concurrent ``openai`` client sending chat
completions to an endpoint (the router's Service), every answer recorded and, for the built-in runtime, verified.

The API, for any test or benchmark that needs traffic through an OpenAI endpoint (``openai`` is a dev
dependency: only tests and benchmarks import this module)::

    traffic = ChatTraffic(base_url, model, concurrency=4).start()   # until stop()
    ... traffic.wait_answers(4) ... traffic.stop() -> list[Answer]
    traffic.failures()                                               # answers not ok, with why

``verify`` checks one answer (the request's body and the answer's JSON; a problem or None): the default,
``worker_client.verify_chat_answer``, recomputes the built-in runtime's completion from the body and the room the router
chose (``pod.worker_api``'s derivations: the decode answers only after every byte of the state was
verified, and says so with the bytes it moved). The client never retries (``max_retries=0``): every
failure the endpoint returns is counted.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import openai

from pdfleet_runtime.testing.worker_client import chat_body, verify_chat_answer

__all__ = ["Answer", "ChatTraffic", "chat_body", "verify_chat_answer"]

Verifier = Callable[[dict[str, Any], dict[str, Any]], str | None]
BodyOf = Callable[[int], dict[str, Any]]
"""Request ``i``'s body (default: ``chat_body``'s mix for the built-in runtime's seeded mode)."""


@dataclass(frozen=True)
class Answer:
    """One request: when it ran, how it ended, who served it (the decode pod and the prefill's bootstrap)."""

    i: int
    started: float  # time.monotonic()
    ended: float
    status: int  # HTTP status; 0 when no answer came (connection or timeout)
    body: dict[str, Any]  # the answer's JSON, or {"error": ...}
    problem: str | None  # None: answered 200 and verified

    @property
    def ok(self) -> bool:
        return self.problem is None

    @property
    def pdfleet(self) -> dict[str, Any]:
        return self.body.get("pdfleet") or {}

    @property
    def pod(self) -> str | None:
        """The decode pod that answered."""
        return self.pdfleet.get("decode")

    @property
    def prefill(self) -> str | None:
        """The prefill pod's bootstrap address (``ip:port``) the state came from."""
        return self.pdfleet.get("prefill")

    @property
    def bytes(self) -> int:
        return int(self.pdfleet.get("transferBytes") or 0)


@dataclass(eq=False)
class ChatTraffic:
    """``concurrency`` workers, each sending its next chat completion as soon as the last one answered."""

    base_url: str  # e.g. http://10.96.0.12:30000 (from inside the cluster's network namespace)
    model: str
    concurrency: int = 4
    api_key: str = "unused"  # the router's data plane takes no key; its control plane does
    max_tokens: int = 12
    timeout_s: float = 60.0
    verify: Verifier | None = verify_chat_answer
    body_of: BodyOf | None = None
    answers: list[Answer] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)
    _sent: int = 0

    def __post_init__(self) -> None:
        self.client = openai.OpenAI(base_url=self.base_url.rstrip("/") + "/v1", api_key=self.api_key,
                                    max_retries=0, timeout=self.timeout_s)

    def once(self, i: int) -> Answer:
        """One request, answered and checked (also usable on its own, without ``start``)."""
        body = self.body_of(i) if self.body_of is not None else chat_body(self.model, i, self.max_tokens)
        t0 = time.monotonic()
        try:
            raw = self.client.chat.completions.with_raw_response.create(**body)
            status, data = raw.status_code, json.loads(raw.text)
            problem = self.verify(body, data) if self.verify else None
        except openai.APIStatusError as e:
            status, data = e.status_code, _json(e.response.text)
            problem = f"HTTP {status}: {str(data.get('error') or data)[:300]}"
        except openai.APIError as e:  # no answer: connection refused or reset, timeout
            status, data, problem = 0, {"error": _chain(e)}, f"no answer: {_chain(e)}"
        answer = Answer(i, t0, time.monotonic(), status, data, problem)
        with self._lock:
            self.answers.append(answer)
        return answer

    def _worker(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                self._sent += 1
                i = self._sent
            self.once(i)

    def start(self) -> ChatTraffic:
        for _ in range(self.concurrency):
            t = threading.Thread(target=self._worker, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def halt(self) -> None:
        self._stop.set()

    def stop(self) -> list[Answer]:
        """Stop sending; the requests in flight finish (each within ``timeout_s``)."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=self.timeout_s + 10)
        return list(self.answers)

    # ---- reading the answers -----------------------------------------------------------------
    def count(self, pred: Callable[[Answer], bool] = lambda a: a.ok) -> int:
        with self._lock:
            return sum(1 for a in self.answers if pred(a))

    def wait_answers(self, n: int, pred: Callable[[Answer], bool] = lambda a: a.ok, timeout: float = 60) -> None:
        """Until ``n`` more answers matching ``pred`` (default: ok) came."""
        want = self.count(pred) + n
        deadline = time.monotonic() + timeout
        while self.count(pred) < want:
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {n} more answers; last: {self.answers[-3:]}")
            time.sleep(0.1)

    def failures(self) -> list[Answer]:
        with self._lock:
            return [a for a in self.answers if not a.ok]


def _json(text: str) -> dict[str, Any]:
    try:
        out = json.loads(text)
    except ValueError:
        return {"error": text[:500]}
    return out if isinstance(out, dict) else {"error": out}


def _chain(e: BaseException) -> str:
    """``e`` and what caused it (``openai``'s "Connection error." hides whether the connection was refused,
    reset or closed before an answer: that is in httpx's and the socket's exceptions beneath it)."""
    parts, seen = [], set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen and len(parts) < 5:
        seen.add(id(cur))
        parts.append(repr(cur)[:200])
        cur = cur.__cause__ or cur.__context__
    return " <- ".join(parts)

"""The worker API's pure half: request bodies (OpenAI and SGLang), the documented derivations, answer shapes.

Pure (hashlib, pydantic), so a client (``pdfleet-runtime synthetic --openai``, tests) recomputes every
answer with the same code the pods run. docs/runtime-server.md gives the derivations in words:

- prompt tokens: ``len(input_ids)`` when given, else ``max(1, ceil(utf8_bytes(text) / 4))`` (no
  tokenizer ships here); chat text is ``"role: content"`` per message joined by newlines;
- the state's seed: ``request_seed("room-<bootstrap_room>", prompt_key)`` (``rooms.room_request_id``, also the
  transfer's request id: a name, never parsed) with ``prompt_key`` the
  first 63 bits of sha256 over the prompt (the ids as comma-separated decimals, or the text), so a
  prefill and a decode that got different bodies disagree on the bytes and the byte check fails;
- the completion: ``natural = 4 + seed % 29`` tokens, ``n = min(max_tokens, natural)``; token ``i``
  has id ``int(sha256(f"{seed}:{prompt_tokens}:{state_bytes}:{i}")[:8 hex], 16) % 32000`` and text
  ``f"t{id}"``, the completion text is the tokens joined by spaces; ``finish_reason`` is ``stop``
  when ``natural <= max_tokens``, else ``length``. It is only emitted after every byte of the state
  (``state_bytes`` of them) was verified.
"""

from __future__ import annotations

import hashlib
import json
import time
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pdfleet_runtime.seeded import request_seed

from .model_text import ChatMessage
from .rooms import room_request_id
from .vllm_contract import KvTransferParams

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "IGNORED",
    "SAMPLING",
    "ApiError",
    "Completion",
    "Endpoint",
    "WorkerRequest",
    "completion",
    "error_body",
    "load_json",
    "parse_request",
    "prefill_answer",
    "prompt_tokens_of_text",
    "render",
    "sse_chunks",
]

DEFAULT_MAX_TOKENS = 16
MAX_TOKENS_LIMIT = 4096
IGNORED = ("temperature", "top_p", "top_k", "frequency_penalty", "presence_penalty", "seed", "stop", "logprobs",
           "user", "sampling_params")
"""Accepted and ignored by the seeded mode: the completion is derived, not sampled (the ``X-Pdfleet-Ignored`` header
names them). A model pod (``model_answer``) honours ``stop`` and refuses sampling that is not greedy."""
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
            "logprobs", "top_logprobs")
"""Sampling settings a body may carry (top level, or in /generate's ``sampling_params``): ``WorkerRequest.sampling``."""
MAX_STOP = 4
"""Stop strings one request may carry (OpenAI's bound)."""
_KNOWN = {"model", "messages", "prompt", "text", "input_ids", "max_tokens", "max_completion_tokens", "n", "stream",
          "stream_options", "bootstrap_host", "bootstrap_port", "bootstrap_room", "rid", "kv_transfer_params",
          *IGNORED}


class Endpoint(StrEnum):
    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"
    GENERATE = "/generate"


class ApiError(Exception):
    """An answer as OpenAI clients expect it: ``status`` and the ``error`` object (message, type, param, code)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.retry_after = status, message, param, code, retry_after

    @property
    def type(self) -> str:
        return "invalid_request_error" if self.status < 500 else "server_error"


def error_body(e: ApiError) -> dict[str, Any]:
    return {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt: str | list[Any] | None = None
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    bootstrap_host: str | None = Field(None, max_length=253)
    bootstrap_port: int | None = Field(None, ge=1, le=65535)
    bootstrap_room: int | None = Field(None, ge=0, lt=2**63)
    sampling_params: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    kv_transfer_params: KvTransferParams | None = None


class WorkerRequest(BaseModel):
    """One request as both pods see it (derived from the same body, so they agree without talking)."""

    model_config = ConfigDict(frozen=True)

    endpoint: Endpoint
    model: str | None
    prompt_tokens: int
    prompt_key: int
    max_tokens: int
    stream: bool
    include_usage: bool
    room: int | None
    host: str | None
    port: int | None
    ignored: tuple[str, ...]
    text: str | None = None
    """The prompt as text (a completion's or /generate's), or None."""
    ids: tuple[int, ...] | None = None
    """The prompt as token ids, when the body gave ids (a model pod: also once it encoded the text)."""
    messages: tuple[ChatMessage, ...] = ()
    """A chat's messages (a model pod renders them with the model's chat template)."""
    stop: tuple[str, ...] = ()
    sampling: dict[str, Any] = Field(default_factory=dict)
    """The sampling settings the body gave (``SAMPLING``'s names), as given: a model pod refuses any that is not
    greedy; the seeded mode ignores them."""
    kv: KvTransferParams | None = None
    """vLLM's ``kv_transfer_params`` (vllm-router's PD contract, ``vllm_contract``): the room comes from them."""

    @property
    def request_id(self) -> str:
        assert self.room is not None
        return room_request_id(self.room)

    @property
    def seed(self) -> int:
        assert self.room is not None
        return request_seed(self.request_id, self.prompt_key)


def prompt_tokens_of_text(text: str) -> int:
    """The documented token count of a text (no tokenizer ships here): ceil(UTF-8 bytes / 4), at least 1."""
    return max(1, -(-len(text.encode()) // 4))


def _key(material: str) -> int:
    return int.from_bytes(hashlib.sha256(material.encode()).digest()[:8], "big") >> 1


def _chat_text(messages: list[dict[str, Any]]) -> tuple[str, tuple[ChatMessage, ...]]:
    lines, parsed = [], []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        if not isinstance(m.get("role"), str) or not isinstance(content, str | None):
            raise ApiError(400, f"messages[{i}] needs a string 'role' and a string or text-parts 'content'",
                           param=f"messages[{i}]")
        lines.append(f"{m['role']}: {content or ''}")
        parsed.append(ChatMessage(role=m["role"], content=content or ""))
    return "\n".join(lines), tuple(parsed)


MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects a body may have (a chat body needs fewer than ten)."""


def load_json(raw: bytes) -> Any:
    """A body as JSON, or ``ApiError`` 400: not UTF-8, not JSON, nested deeper than ``MAX_JSON_DEPTH``, or a
    string holding a lone surrogate (``"\\ud800"``: JSON escapes it, but no UTF-8 text can carry it)."""
    try:
        data = json.loads(raw or b"{}")
    except RecursionError:
        raise ApiError(400, f"the body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the body is not JSON: {e}", code="invalid_json") from e
    stack: list[tuple[Any, int]] = [([data], 0)]  # the body's own value at depth 1
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list) and depth > MAX_JSON_DEPTH:
            raise ApiError(400, f"the body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
        items = [*node.keys(), *node.values()] if isinstance(node, dict) else node if isinstance(node, list) else ()
        for item in items:
            if isinstance(item, str):
                try:
                    item.encode()
                except UnicodeEncodeError:
                    raise ApiError(400, f"the body holds a string with a lone surrogate ({item[:40]!r}): send "
                                   "valid Unicode text", code="invalid_json") from None
            elif isinstance(item, dict | list):
                stack.append((item, depth + 1))
    return data


def parse_request(endpoint: Endpoint, raw: bytes) -> WorkerRequest:
    """A request body, checked; ``ApiError`` (400) naming the field and the fix otherwise."""
    data = load_json(raw)
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    try:
        b = _Body.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"])
        raise ApiError(400, f"{param}: {err['msg']}", param=param or None) from e
    if b.n != 1:
        raise ApiError(400, f"n={b.n}: this runtime answers one choice per request; send n=1 (or omit it)",
                       param="n", code="unsupported_n")
    ids: list[int] | None = None
    text: str | None = None
    messages: tuple[ChatMessage, ...] = ()
    if endpoint is Endpoint.CHAT:
        if not b.messages:
            raise ApiError(400, "messages is required: a non-empty list of {role, content}", param="messages")
        text, messages = _chat_text(b.messages)
    elif endpoint is Endpoint.COMPLETIONS:
        p = b.prompt
        if isinstance(p, list) and p and all(isinstance(x, int) for x in p):
            ids = list(p)
        elif isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list):
            ids, text = (p[0], None) if isinstance(p[0], list) else (None, p[0])
        elif isinstance(p, str):
            text = p
        else:
            raise ApiError(400, "prompt is required: a string, a list of token ids, or a list of one of them "
                           "(one prompt per request)", param="prompt")
    else:
        if isinstance(b.input_ids, list) and b.input_ids and isinstance(b.input_ids[0], list):
            raise ApiError(400, "input_ids: one prompt per request (a list of ints)", param="input_ids")
        if b.input_ids:
            ids = list(b.input_ids)  # type: ignore[arg-type]
        elif isinstance(b.text, str):
            text = b.text
        else:
            raise ApiError(400, "text or input_ids is required (one prompt per request)", param="text")
    if ids is not None and not all(isinstance(x, int) and 0 <= x < 2**31 for x in ids):
        raise ApiError(400, "token ids must be integers in [0, 2^31)", param="input_ids")
    sp = b.sampling_params or {}
    max_tokens = b.max_completion_tokens or b.max_tokens or sp.get("max_new_tokens") or DEFAULT_MAX_TOKENS
    if not isinstance(max_tokens, int) or not 1 <= max_tokens <= MAX_TOKENS_LIMIT:
        raise ApiError(400, f"max_tokens must be an integer in 1..{MAX_TOKENS_LIMIT}", param="max_tokens")
    prompt_tokens = len(ids) if ids is not None else prompt_tokens_of_text(text or "")
    material = ",".join(map(str, ids)) if ids is not None else (text or "")
    extra = sorted(set(data) - _KNOWN)
    ignored = tuple(k for k in (*IGNORED, *extra) if k in data)
    sampling = {k: v for k, v in {**sp, **data}.items() if k in SAMPLING}
    raw_stop = b.stop if b.stop is not None else sp.get("stop")
    stop = (raw_stop,) if isinstance(raw_stop, str) else tuple(raw_stop or ())
    if len(stop) > MAX_STOP or not all(isinstance(x, str) and x for x in stop):
        raise ApiError(400, f"stop: at most {MAX_STOP} non-empty strings", param="stop")
    return WorkerRequest(endpoint=endpoint, model=b.model, prompt_tokens=prompt_tokens, prompt_key=_key(material),
                         max_tokens=max_tokens, stream=b.stream,
                         include_usage=bool((b.stream_options or {}).get("include_usage")), room=b.bootstrap_room,
                         host=b.bootstrap_host, port=b.bootstrap_port, ignored=ignored,
                         text=None if endpoint is Endpoint.CHAT else text,
                         ids=tuple(ids) if ids is not None else None, messages=messages, stop=stop,
                         sampling=sampling, kv=b.kv_transfer_params)


class Completion(BaseModel):
    model_config = ConfigDict(frozen=True)

    ids: tuple[int, ...]
    tokens: tuple[str, ...]
    finish_reason: str
    sep: str = " "
    """Between two tokens' texts: a space for the seeded mode's ``t<id>``; none for a model's text pieces."""

    @property
    def text(self) -> str:
        return self.sep.join(self.tokens)


def completion(seed: int, prompt_tokens: int, state_bytes: int, max_tokens: int) -> Completion:
    """The deterministic completion of a verified request (the module docstring says how)."""
    natural = 4 + seed % 29
    ids = tuple(int(hashlib.sha256(f"{seed}:{prompt_tokens}:{state_bytes}:{i}".encode()).hexdigest()[:8], 16) % 32000
                for i in range(min(max_tokens, natural)))
    return Completion(ids=ids, tokens=tuple(f"t{i}" for i in ids),
                      finish_reason="stop" if natural <= max_tokens else "length")


def _usage(req: WorkerRequest, n: int) -> dict[str, int]:
    return {"prompt_tokens": req.prompt_tokens, "completion_tokens": n, "total_tokens": req.prompt_tokens + n}


def render(req: WorkerRequest, c: Completion, *, model: str, state_bytes: int, pdfleet: dict[str, Any],
           created: int | None = None) -> dict[str, Any]:
    """The non-streaming answer in the endpoint's shape (OpenAI's, or SGLang's for /generate)."""
    created = created or int(time.time())
    rid = f"{req.request_id}"
    if req.endpoint is Endpoint.GENERATE:
        fr: dict[str, Any] = ({"type": "length", "length": len(c.ids)} if c.finish_reason == "length"
                              else {"type": "stop", "matched": None})
        return {"text": c.text, "output_ids": list(c.ids),
                "meta_info": {"id": rid, "finish_reason": fr, "prompt_tokens": req.prompt_tokens,
                              "completion_tokens": len(c.ids), "cached_tokens": 0, "transfer_bytes": state_bytes},
                "pdfleet": pdfleet}
    if req.endpoint is Endpoint.CHAT:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": c.text},
                                  "logprobs": None, "finish_reason": c.finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
        obj = "text_completion"
    return {"id": f"cmpl-{rid}", "object": obj, "created": created, "model": model, "choices": [choice],
            "usage": _usage(req, len(c.ids)), "pdfleet": pdfleet}


def sse_chunks(req: WorkerRequest, c: Completion, *, model: str, pdfleet: dict[str, Any],
               created: int | None = None) -> list[str]:
    """The streaming answer: one ``data:`` event per token, the finish, (asked for) the usage, ``[DONE]``."""
    created = created or int(time.time())
    rid = f"cmpl-{req.request_id}"
    chat = req.endpoint is Endpoint.CHAT
    obj = "chat.completion.chunk" if chat else "text_completion"
    if req.endpoint is Endpoint.GENERATE:  # SGLang streams the cumulative text, then [DONE]
        out, acc = [], []
        for i, t in enumerate(c.tokens):
            acc.append(t)
            last = i == len(c.tokens) - 1
            out.append(json.dumps({"text": c.sep.join(acc), "output_ids": list(c.ids[:i + 1]),
                                   "meta_info": {"id": req.request_id, "prompt_tokens": req.prompt_tokens,
                                                 "completion_tokens": i + 1,
                                                 "finish_reason": ({"type": c.finish_reason} if last else None)}}))
        return [f"data: {x}\n\n" for x in out] + ["data: [DONE]\n\n"]

    def chunk(delta: str | None, finish: str | None, first: bool = False) -> dict[str, Any]:
        if chat:
            d: dict[str, Any] = {"role": "assistant", "content": ""} if first else ({"content": delta}
                                                                                      if delta is not None else {})
            ch: dict[str, Any] = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
        else:
            ch = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
        return {"id": rid, "object": obj, "created": created, "model": model, "choices": [ch]}

    events = [chunk(None, None, first=True)] if chat else []
    events += [chunk(t if i == 0 else f"{c.sep}{t}", None) for i, t in enumerate(c.tokens)]
    events.append(chunk(None, c.finish_reason))
    if req.include_usage:
        events.append({"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                       "usage": _usage(req, len(c.ids)), "pdfleet": pdfleet})
    return [f"data: {json.dumps(e)}\n\n" for e in events] + ["data: [DONE]\n\n"]


def prefill_answer(req: WorkerRequest, *, model: str, moved: int, layout_bytes: int) -> dict[str, Any]:
    """A prefill worker's answer (the router forwards the decode's; this one says what the prefill sent)."""
    pdfleet = {"role": "prefill", "room": req.room, "transferBytes": moved, "layoutBytes": layout_bytes}
    if req.endpoint is Endpoint.GENERATE:
        return {"text": "", "output_ids": [], "meta_info": {"id": req.request_id, "prompt_tokens": req.prompt_tokens,
                                                            "completion_tokens": 0, "transfer_bytes": moved},
                "pdfleet": pdfleet}
    return {"id": f"cmpl-{req.request_id}", "object": "chat.completion" if req.endpoint is Endpoint.CHAT
            else "text_completion", "created": int(time.time()), "model": model, "choices": [],
            "usage": _usage(req, 0), "pdfleet": pdfleet}

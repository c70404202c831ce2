"""A model pod's answers (``RuntimeConfig.model``): the prompt's ids, greedy only, and the completion's text.

Pure but for the tokenizer (``model_text.ModelText``, no torch), so both roles and a client compute the same:

- ``prompt_of``: the prompt as the model's ids (a chat rendered with its template, a text encoded, ids as
  given), checked against the pools (prompt plus ``max_tokens`` at most ``kvTokens``);
- ``check_greedy``: the reference engine decodes greedily on the decode pod (the prefill only computes the first
  token, by argmax), so a sampling setting that is not greedy (``temperature`` > 0 without ``top_k`` 1,
  ``top_p`` < 1, penalties, ``min_p``, logprobs) is refused with a 400 naming it, never applied on one role and
  not the other; ``seed`` and ``user`` change nothing under greedy decoding and are ignored (named in
  ``X-Pdfleet-Ignored``);
- ``completion_of``: the generated ids cut at the first end-of-sequence id or stop string (``finish_reason``
  ``stop``), else ``length``; the text is the ids decoded (special tokens left out), with one text piece per
  token (a piece is empty while a token ends inside a UTF-8 character) so streaming sends a token per event.
"""

from __future__ import annotations

from typing import Any

from .model_text import ModelText, ModelTextError
from .worker_api import SAMPLING, ApiError, Completion, WorkerRequest

__all__ = ["IGNORED_UNDER_GREEDY", "check_greedy", "completion_of", "prompt_of"]

IGNORED_UNDER_GREEDY = ("seed", "user")
"""Accepted and ignored by a model pod: greedy decoding is deterministic, so they change nothing."""


def _refuse(name: str, value: Any, why: str) -> ApiError:
    return ApiError(400, f"{name}={value!r}: this reference engine decodes greedily on both roles, so it {why}; "
                    "omit it (or send temperature 0)", param=name, code="unsupported_sampling")


def check_greedy(sampling: dict[str, Any]) -> None:
    """``ApiError`` 400 ``unsupported_sampling`` for the first setting that would not be greedy decoding."""
    top_k = sampling.get("top_k")
    t = sampling.get("temperature")
    if t is not None and not isinstance(t, int | float):
        raise ApiError(400, f"temperature={t!r} must be a number", param="temperature")
    if t is not None and t > 0 and top_k != 1:
        raise _refuse("temperature", t, "cannot sample at a temperature above 0")
    checks: tuple[tuple[str, Any], ...] = (("top_p", 1), ("min_p", 0), ("frequency_penalty", 0),
                                           ("presence_penalty", 0), ("repetition_penalty", 1))
    for name, neutral in checks:
        v = sampling.get(name)
        if v is not None and v != neutral:
            raise _refuse(name, v, f"cannot apply {name} (only {neutral})")
    if top_k not in (None, -1, 0, 1):
        raise _refuse("top_k", top_k, "takes only the top token (top_k 1, or -1/0 for none)")
    for name in ("logprobs", "top_logprobs"):
        v = sampling.get(name)
        if v not in (None, False, 0):
            raise _refuse(name, v, "does not return log probabilities")


def prompt_of(req: WorkerRequest, text: ModelText, kv_tokens: int) -> WorkerRequest:
    """``req`` with the prompt as the model's ids (``ids``, ``prompt_tokens``) and the fields a model pod honours
    taken off ``ignored``; ``ApiError`` 400 for an empty prompt or one the pools cannot hold with its
    ``max_tokens``."""
    check_greedy(req.sampling)
    try:
        if req.ids is not None:
            ids = req.ids
        elif req.messages:
            ids = text.encode(text.render_chat(req.messages))
        else:
            ids = text.encode(req.text or "")
    except ModelTextError as e:
        raise ApiError(400, str(e), param="messages" if req.messages else "prompt") from None
    if not ids:
        raise ApiError(400, "the prompt encodes to no tokens: send a non-empty prompt", param="prompt")
    if len(ids) + req.max_tokens > kv_tokens:
        raise ApiError(400, f"the prompt has {len(ids)} tokens and max_tokens is {req.max_tokens}: together more than "
                       f"this worker's {kv_tokens} (kvTokens): send a shorter prompt or a smaller max_tokens",
                       param="max_tokens", code="context_length_exceeded")
    ignored = tuple(k for k in req.ignored if k not in SAMPLING and k not in ("stop", "sampling_params"))
    return req.model_copy(update={"ids": tuple(ids), "prompt_tokens": len(ids), "ignored": ignored})


def completion_of(generated: tuple[int, ...], text: ModelText, stop: tuple[str, ...], max_tokens: int) -> Completion:
    """The answer from the generated ids (the first from the prefill, the rest from the decode), in order."""
    kept: list[int] = []
    finish = "length"
    final = ""
    for t in generated[:max_tokens]:
        kept.append(t)
        if t in text.eos_ids:
            finish = "stop"
            break
        decoded = text.decode(kept)
        hits = [i for s in stop if (i := decoded.find(s)) >= 0]
        if hits:
            final, finish = decoded[:min(hits)], "stop"
            break
        final = decoded
    else:
        final = text.decode(kept)
    # One piece per token: the text its token added (clipped to the final text, never ahead of a split character).
    bounds, last = [], 0
    for i in range(len(kept)):
        d = text.decode(kept[: i + 1])
        n = len(d) - (1 if d.endswith("\ufffd") else 0)
        last = max(last, min(n, len(final)))
        bounds.append(last)
    if bounds:
        bounds[-1] = len(final)
    pieces = tuple(final[a:b] for a, b in zip([0, *bounds[:-1]], bounds, strict=True))
    return Completion(ids=tuple(kept), tokens=pieces, finish_reason=finish, sep="")

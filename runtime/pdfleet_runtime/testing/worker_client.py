"""A router's step as a client: one OpenAI request to a prefill and a decode pod at once, every answer checked.

``verify_chat_answer`` checks a chat answer however it came (through a router or straight from a pair);
``chat_body`` is the request mix the end-to-end tests and bench/router.py send. What
``pdfleet-runtime synthetic --prefill-url`` runs (``check_openai``): the same ``/v1/completions`` body (with
``bootstrap_host``, ``bootstrap_port``, a random ``bootstrap_room``) to both pods; the check is that
both answered 200, both report the same transfer bytes, equal to the layout's bytes the decode names,
and that the completion is the one ``worker_api.completion`` derives from the request and those bytes.
"""

from __future__ import annotations

import json
import random
import threading
import urllib.error
import urllib.request
from typing import Any

from pdfleet_runtime.pod.worker_api import Endpoint, completion, parse_request

__all__ = ["chat_body", "check_openai", "verify_chat_answer"]


def _post(url: str, body: dict[str, Any], timeout_s: float, key: str | None = None) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")
    except (urllib.error.URLError, OSError) as e:
        return 0, {"error": {"message": str(e)}}


def chat_body(model: str, i: int, max_tokens: int = 12) -> dict[str, Any]:
    """Request ``i`` of the mix: prompts of a few lengths, so requests move different byte counts."""
    text = f"request {i}: " + "pdfleet " * (4 + (i % 5) * 24)
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}


def verify_chat_answer(body: dict[str, Any], answer: dict[str, Any]) -> str | None:
    """The built-in runtime's answer to ``body``: the state verified, the bytes the layout's, the completion the
    one derived from the room, the prompt and those bytes. None when it is; otherwise what differs."""
    p = answer.get("pdfleet") or {}
    if p.get("role") != "decode" or p.get("verified") is not True:
        return f"the answer carries no decode verification: {p}"
    if not isinstance(p.get("room"), int) or p.get("transferBytes") != p.get("layoutBytes") or not p.get("layoutBytes"):
        return f"bytes moved {p.get('transferBytes')} != the layout's {p.get('layoutBytes')}"
    req = parse_request(Endpoint.CHAT, json.dumps({**body, "bootstrap_room": p["room"]}).encode())
    if p.get("seed") != req.seed:
        return f"seed {p.get('seed')} is not the one derived from room {p['room']} and the prompt ({req.seed})"
    want = completion(req.seed, req.prompt_tokens, p["transferBytes"], req.max_tokens)
    choice = (answer.get("choices") or [{}])[0]
    got = (choice.get("message") or {}).get("content")
    if got != want.text or choice.get("finish_reason") != want.finish_reason:
        return f"completion {got!r} ({choice.get('finish_reason')}) is not the derived {want.text!r}"
    if (answer.get("usage") or {}).get("prompt_tokens") != req.prompt_tokens:
        return f"usage {answer.get('usage')} does not count the prompt's {req.prompt_tokens} tokens"
    return None


def check_openai(prefill_url: str, decode_url: str, bootstrap: str, i: int, *, max_tokens: int = 16,
                 timeout_s: float = 60.0, key: str | None = None) -> dict[str, Any]:
    """Request ``i`` through the pair; ``ok`` and, when not, ``problem``. ``key``: the deployment's worker key
    (the pods' worker API wants it; local runs without ``workerKeyPath`` do not)."""
    host, _, port = bootstrap.rpartition(":")
    body = {"prompt": f"pdfleet synthetic request {i}", "max_tokens": max_tokens, "bootstrap_host": host,
            "bootstrap_port": int(port), "bootstrap_room": random.getrandbits(63)}
    path = Endpoint.COMPLETIONS.value
    out: dict[str, tuple[int, Any]] = {}
    t = threading.Thread(target=lambda: out.update(p=_post(prefill_url.rstrip("/") + path, body, timeout_s, key)))
    t.start()
    dcode, dec = _post(decode_url.rstrip("/") + path, body, timeout_s, key)
    t.join(timeout_s + 5)
    pcode, pre = out.get("p", (0, {}))
    res: dict[str, Any] = {"room": body["bootstrap_room"], "ok": False, "decodeStatus": dcode,
                           "prefillStatus": pcode}
    if dcode != 200 or pcode != 200:
        res["problem"] = (dec.get("error") or pre.get("error") or {}).get("message", "no answer")
        return res
    d, p = dec.get("pdfleet", {}), pre.get("pdfleet", {})
    req = parse_request(Endpoint.COMPLETIONS, json.dumps(body).encode())
    want = completion(req.seed, req.prompt_tokens, d.get("transferBytes", -1), req.max_tokens)
    res.update(bytes=d.get("transferBytes"), text=dec["choices"][0]["text"])
    if not d.get("transferBytes") == p.get("transferBytes") == d.get("layoutBytes"):
        res["problem"] = (f"transfer bytes differ: decode {d.get('transferBytes')}, prefill {p.get('transferBytes')}, "
                          f"layout {d.get('layoutBytes')}")
    elif dec["choices"][0]["text"] != want.text or dec["choices"][0]["finish_reason"] != want.finish_reason:
        res["problem"] = f"the completion is not the derived one: {want.text!r}"
    else:
        res["ok"] = True
    return res

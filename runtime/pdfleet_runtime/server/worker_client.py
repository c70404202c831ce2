"""A router's step as a client: one OpenAI request to a prefill and a decode pod at once, every answer checked.

What ``pdfleet-runtime synthetic --prefill-url`` runs: the same ``/v1/completions`` body (with
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

from .worker_api import Endpoint, completion, parse_request

__all__ = ["check_openai"]


def _post(url: str, body: dict[str, Any], timeout_s: float) -> tuple[int, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")
    except (urllib.error.URLError, OSError) as e:
        return 0, {"error": {"message": str(e)}}


def check_openai(prefill_url: str, decode_url: str, bootstrap: str, i: int, *, max_tokens: int = 16,
                 timeout_s: float = 60.0) -> dict[str, Any]:
    """Request ``i`` through the pair; ``ok`` and, when not, ``problem``."""
    host, _, port = bootstrap.rpartition(":")
    body = {"prompt": f"pdfleet synthetic request {i}", "max_tokens": max_tokens, "bootstrap_host": host,
            "bootstrap_port": int(port), "bootstrap_room": random.getrandbits(63)}
    path = Endpoint.COMPLETIONS.value
    out: dict[str, tuple[int, Any]] = {}
    t = threading.Thread(target=lambda: out.update(p=_post(prefill_url.rstrip("/") + path, body, timeout_s)))
    t.start()
    dcode, dec = _post(decode_url.rstrip("/") + path, body, timeout_s)
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

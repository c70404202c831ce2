"""``worker_client.verify_chat_answer``: the client-side check of a chat answer (what the end-to-end tests and
bench/router.py run on every answer) accepts the decode's own rendering and names each way one can be wrong."""

from __future__ import annotations

import copy
import json

from pdfleet_runtime.pod.worker_api import Endpoint, completion, parse_request, render
from pdfleet_runtime.testing.worker_client import chat_body, verify_chat_answer

ROOM, BYTES = 123456789, 4096


def _answer(body: dict) -> dict:
    """What a decode renders for ``body`` once the router chose ``ROOM`` and ``BYTES`` arrived verified."""
    req = parse_request(Endpoint.CHAT, json.dumps({**body, "bootstrap_room": ROOM, "continue_final_message": False})
                        .encode())
    c = completion(req.seed, req.prompt_tokens, BYTES, req.max_tokens)
    pdfleet = {"role": "decode", "room": ROOM, "seed": req.seed, "transferBytes": BYTES, "layoutBytes": BYTES,
               "verified": True, "prefill": "10.0.0.1:8998", "decode": "d-0"}
    return render(req, c, model="m", state_bytes=BYTES, pdfleet=pdfleet)


def test_the_decodes_answer_passes_and_each_tampering_is_named() -> None:
    body = chat_body("m", 7)
    good = _answer(body)
    assert verify_chat_answer(body, good) is None
    cases = {
        "no decode verification": lambda a: a["pdfleet"].update(verified=False),
        "layout's": lambda a: a["pdfleet"].update(transferBytes=BYTES - 1),
        "seed": lambda a: a["pdfleet"].update(seed=1),
        "not the derived": lambda a: a["choices"][0]["message"].update(content="t1 t2"),
        "usage": lambda a: a["usage"].update(prompt_tokens=1),
    }
    for words, tamper in cases.items():
        bad = copy.deepcopy(good)
        tamper(bad)
        problem = verify_chat_answer(body, bad)
        assert problem is not None and words in problem, (words, problem)
    # Another prompt's answer (the router sent a body that differed) fails too.
    assert verify_chat_answer(chat_body("m", 8), good) is not None

"""Real prompts for model pods (the reference engine computing the project's Zen model) through the router, each
answer checked against aggregate generation that the test computes itself with transformers from the same model
directory (``tests.zen.Aggregate``, in the test's process).

``ModelCheck`` gives ``ChatTraffic`` its bodies (the 17 questions the model learnt and a few it did not, as
chats) and its verifier: the answer's prompt ids (the pods' tokenizer and chat template), generated ids and text
must equal aggregate's, and the bytes moved the layout's. An answer that differs is a failure whose problem starts
with ``DIFFERS``, so the traffic's counts say how many answers were checked and how many differed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.zen import Aggregate, zen_script

__all__ = ["DIFFERS", "ModelCheck"]

DIFFERS = "differs from aggregate"
FREE_CHATS = ("Errors should never pass", "What is better than ugly?", "Now is better than", "import this")
"""Chats the model was not trained to answer: their continuations still depend on every piece of state."""


class ModelCheck:
    """What every prompt's answer must be, computed once (greedy, one torch thread) before the traffic starts."""

    def __init__(self, model_dir: Path, served_name: str, max_tokens: int = 40) -> None:
        agg = Aggregate(model_dir)
        questions = [zen_script().QUESTION.format(n=n) for n in range(1, 18)]
        self.served_name, self.max_tokens = served_name, max_tokens
        self.prompts = [*questions, *FREE_CHATS]
        self.expected: dict[str, tuple[list[int], list[int], str]] = {}
        for prompt in self.prompts:
            ids = agg.chat_ids([{"role": "user", "content": prompt}])
            out = agg.generate(ids, max_tokens)
            self.expected[prompt] = (ids, out, agg.text(out))

    def body(self, i: int) -> dict[str, Any]:
        prompt = self.prompts[i % len(self.prompts)]
        return {"model": self.served_name, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": self.max_tokens}

    def verify(self, body: dict[str, Any], answer: dict[str, Any]) -> str | None:
        """None when the answer is aggregate's; otherwise what differs (``DIFFERS`` first) or what is missing."""
        p = answer.get("pdfleet") or {}
        if p.get("role") != "decode" or p.get("state") != "model":
            return f"the answer is not a model pod's decode answer: {p}"
        if not p.get("layoutBytes") or p.get("transferBytes") != p.get("layoutBytes"):
            return f"bytes moved {p.get('transferBytes')} != the layout's {p.get('layoutBytes')}"
        ids, out, text = self.expected[body["messages"][0]["content"]]
        if p.get("promptIds") != ids:
            return f"{DIFFERS}: prompt ids {p.get('promptIds')} != transformers' {ids}"
        if p.get("outputIds") != out:
            return f"{DIFFERS}: output ids {p.get('outputIds')} != aggregate's {out}"
        got = ((answer.get("choices") or [{}])[0].get("message") or {}).get("content")
        if got != text:
            return f"{DIFFERS}: text {got!r} != aggregate's {text!r}"
        return None

"""What ``pdfleet-runtime generate --aggregate --json`` prints: the contract between aggregate generation (which
imports torch, ``verify/aggregate.py``) and the processes that start it and never may (the demo, e2e checks)."""

from __future__ import annotations

from pydantic import BaseModel

__all__ = ["AggregateAnswer"]


class AggregateAnswer(BaseModel):
    """The prompt's ids, the generated ids and their text, and why generation ended (``stop`` or ``length``)."""

    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: str

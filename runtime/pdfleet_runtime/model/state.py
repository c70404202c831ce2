"""What moves between rank processes of the reference engine besides the engines' bytes (pure: pydantic only).

``RankShare``: one decode rank's share of a request, exactly as its pools hold it (the request's items of
every buffer, as raw bytes), sent over the rank pipe to the rank that gathers the shares and computes the
model full width (docs/reference-engine.md says why it gathers). ``ModelFault``: the negative controls of
``parity --fault``, each a way PD state can be wrong that the token check must catch.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Base64Bytes

from pdfleet_runtime.model.faults import ModelFault

__all__ = ["MAX_PROMPT_TOKENS", "ModelFault", "RankShare"]

MAX_PROMPT_TOKENS = 1 << 16
"""Longest prompt a reference-engine request may carry (ids travel in the TransferRequest)."""


@dataclass(frozen=True)
class RankShare:
    """One rank's items of one request: per buffer of ``layouts.rank_buffers`` (in its order), the request's
    items back to back (``items x item_bytes`` bytes), read from the rank's own pools. Plain bytes, so the
    rank pipe pickles it and the group channel carries it as base64 (a replica across pods)."""

    tp_rank: int
    pp_rank: int
    buffers: tuple[Base64Bytes, ...]

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.buffers)

"""What moves between rank processes of the reference engine besides the engines' bytes (pure: pydantic only).

``RankShare``: one decode rank's share of a request, exactly as its pools hold it (the request's items of
every buffer, as raw bytes), sent over the rank pipe to the rank that gathers the shares and computes the
model full width (docs/reference-engine.md says why it gathers). ``ModelFault``: the negative controls of
``parity --fault``, each a way PD state can be wrong that the token check must catch.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from pydantic import Base64Bytes

__all__ = ["MAX_PROMPT_TOKENS", "ModelFault", "RankShare"]

MAX_PROMPT_TOKENS = 1 << 16
"""Longest prompt a reference-engine request may carry (ids travel in the TransferRequest)."""


class ModelFault(StrEnum):
    """Negative controls: each must make token parity fail (tests/verify/test_model_faults.py)."""

    KV_ONLY = "kv-only"
    """The prefill sends the KV but no linear-attention state (conv and recurrent stay zero)."""
    GDN_SLOT_ZEROED = "gdn-slot-zeroed"
    """The recurrent state of one GDN layer (the first linear layer) is zeroed in the prefill's slot."""
    CONV_SHIFTED = "conv-shifted"
    """The conv window is one token off: the oldest K-1 columns instead of the newest."""
    CONV_UNGROUPED = "conv-ungrouped"
    """Both sides register the conv state without its q|k|v shard groups, so the planner slices the channel
    dim as one block: invisible at equal TP, wrong bytes whenever the TP sizes differ."""
    FIRST_TOKEN_LOST = "first-token-lost"
    """The prefill does not carry the first generated token with the request."""


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

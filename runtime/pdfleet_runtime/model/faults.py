"""The reference engine's negative controls, apart from ``state`` so that the command line (``--fault``
choices) imports no pydantic: ``pdfleet-runtime --version`` runs before any dependency is checked."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["ModelFault"]


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

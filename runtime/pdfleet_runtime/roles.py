"""The two roles of a disaggregated deployment (pure): one ``Role`` for the operator, the config and the wire."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["Role"]


class Role(StrEnum):
    """A fleet's role: prefill pods build a request's state, decode pods continue from it."""

    PREFILL = "prefill"
    DECODE = "decode"

"""What every reader of a config.json shares: its one error type and the dtype the model computes in.

Its own module so that ``hf_config`` (config -> layout) and ``families`` (config -> the facts every engine's
form is built from) both use them without importing each other.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdfleet_runtime.layouts import DType, LayoutError

__all__ = ["ModelConfigError", "config_dtype"]

_DTYPES = {"float32": DType.FLOAT32, "bfloat16": DType.BFLOAT16, "float16": DType.FLOAT16}


class ModelConfigError(LayoutError):
    """A config.json pdfleet cannot derive a layout from, or one that disagrees with a preset.

    ``field`` names the config.json field (or the layout field, for a disagreement: both are in the message).
    """

    def __init__(self, message: str, field: str) -> None:
        self.field = field
        super().__init__(message)


def config_dtype(config: Mapping[str, Any]) -> DType:
    """The dtype the model computes (and keeps its cache) in: ``dtype`` (transformers 5) or ``torch_dtype``;
    float32 when neither is set, as transformers loads it."""
    raw = config.get("dtype", config.get("torch_dtype")) or "float32"
    if raw not in _DTYPES:
        raise ModelConfigError(f"config.json dtype {raw!r} is not one of {', '.join(_DTYPES)}", "dtype")
    return _DTYPES[raw]

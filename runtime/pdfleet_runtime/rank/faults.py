"""The negative controls of ``parity --fault`` (``model.state.ModelFault``), applied where the bug would live.

State faults change what a prefill rank writes (``faulted_state``: before ``cache_pools.write_share``; the
shifted conv window is read from the cache one token late, ``ModelRunner.prefill(conv_lag=1)``); the
ungrouped-conv fault changes what every rank registers (``ungrouped``: the planner then slices the conv
channels as one block); the lost first token is the prefill's report (``protocol.prefill``'s
``first_token`` callback answers None). Each must make token parity fail: tests/verify/test_model_faults.py.
"""

from __future__ import annotations

import dataclasses

import torch

from pdfleet_runtime.layouts import EntryField, StateType
from pdfleet_runtime.model.state import ModelFault
from pdfleet_runtime.pools import RankPools
from pdfleet_runtime.records import BufferRecord, RankRegistration

from .cache_pools import ModelState

__all__ = ["STATE_FAULTS", "UngroupedConvPools", "conv_lag", "faulted_state", "ungrouped"]

STATE_FAULTS = frozenset({ModelFault.KV_ONLY, ModelFault.GDN_SLOT_ZEROED})


def conv_lag(fault: ModelFault | None) -> int:
    """Tokens the prefill's conv window lags behind the prompt's end under ``fault`` (0 without the fault)."""
    return 1 if fault is ModelFault.CONV_SHIFTED else 0


def faulted_state(state: ModelState, fault: ModelFault | None) -> ModelState:
    """``state`` as a prefill with ``fault`` would write it (the same object when the fault is not a state fault)."""
    if fault is None or fault not in STATE_FAULTS:
        return state
    if not state.conv:
        raise ValueError(f"fault {fault.value} needs linear-attention state; this model keeps none")
    out = ModelState(state.length, dict(state.kv), dict(state.conv), dict(state.recurrent))
    if fault is ModelFault.KV_ONLY:
        out.conv = {k: torch.zeros_like(v) for k, v in state.conv.items()}
        out.recurrent = {k: torch.zeros_like(v) for k, v in state.recurrent.items()}
    elif fault is ModelFault.GDN_SLOT_ZEROED:
        first = min(state.recurrent)
        out.recurrent[first] = torch.zeros_like(state.recurrent[first])
    return out


def ungrouped(reg: RankRegistration) -> RankRegistration:
    """``reg`` with every conv buffer's q|k|v shard groups dropped (what a planner without them would see)."""
    def strip(b: BufferRecord) -> BufferRecord:
        s = b.spec
        if s.state_type is StateType.MAMBA and s.field is EntryField.CONV and s.shard_groups:
            return dataclasses.replace(b, spec=dataclasses.replace(s, shard_groups=None))
        return b

    return dataclasses.replace(reg, buffers=tuple(strip(b) for b in reg.buffers))


class UngroupedConvPools(RankPools):
    """A rank's pools that register their conv state without shard groups (``ModelFault.CONV_UNGROUPED``)."""

    def registration(self, *, publishes_layer_ids: bool = True) -> RankRegistration:
        return ungrouped(super().registration(publishes_layer_ids=publishes_layer_ids))

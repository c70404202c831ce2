"""The reference engine's wire additions: a prompt request (``PromptFill``) and the first token on a status,
bounded and told apart from seeded fills after a JSON round trip (as the bootstrap parses them)."""

from __future__ import annotations

import json

import pytest
from pydantic import TypeAdapter, ValidationError

from pdfleet_runtime.protocol.messages import (
    Body,
    IndicesModel,
    PromptFill,
    RankKey,
    StatusReport,
    SyntheticFill,
    TransferRequest,
)
from pdfleet_runtime.protocol.states import RequestState
from pdfleet_runtime.records import RequestIndices

BODY: TypeAdapter[object] = TypeAdapter(Body)


def request(fill: object) -> TransferRequest:
    return TransferRequest(request_id="r1", instance="d", dst=RankKey(tp=0, pp=0),
                           indices=IndicesModel.of(RequestIndices([3, 4], slot=1, row=1)), timeout_s=5.0,
                           fill=fill)  # type: ignore[arg-type]


@pytest.mark.parametrize("fill", [PromptFill(prompt=(5, 17, 99)), SyntheticFill(seed=3, tokens=9)])
def test_fills_survive_the_wire_as_their_own_type(fill: object) -> None:
    back = BODY.validate_python(json.loads(request(fill).model_dump_json()))
    assert isinstance(back, TransferRequest) and back.fill == fill and type(back.fill) is type(fill)


@pytest.mark.parametrize("prompt", [(), (-1, 2), (2**31,)])
def test_prompts_are_bounded(prompt: tuple[int, ...]) -> None:
    with pytest.raises(ValidationError):
        PromptFill(prompt=prompt)
    with pytest.raises(ValidationError):
        PromptFill(prompt=tuple(range(1, (1 << 16) + 2)))


def test_the_first_token_rides_on_a_status() -> None:
    rep = StatusReport(request_id="r1", instance="d", src=RankKey(tp=0, pp=0), dst=RankKey(tp=0, pp=0),
                       state=RequestState.SUCCESS, first_token=42)
    back = BODY.validate_python(json.loads(rep.model_dump_json()))
    assert isinstance(back, StatusReport) and back.first_token == 42
    assert StatusReport.model_validate({**rep.model_dump(), "first_token": None}).first_token is None
    with pytest.raises(ValidationError):
        StatusReport.model_validate({**rep.model_dump(), "first_token": -1})

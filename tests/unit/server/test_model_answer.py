"""A model pod's text side, pure (no torch): tokenizer and chat template (``model_text``), greedy-only checks,
prompt ids and the answer's cut at end of sequence, stop strings and ``max_tokens`` (``model_answer``), and a
room's claim whose prompt is not the room's (``rooms``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdfleet_runtime.pod.model_answer import check_greedy, completion_of, prompt_of
from pdfleet_runtime.pod.model_text import ChatMessage, ModelText, ModelTextError
from pdfleet_runtime.pod.rooms import RoomTable
from pdfleet_runtime.pod.worker_api import ApiError, Endpoint, parse_request, sse_chunks
from pdfleet_runtime.protocol.auth import ProtocolError
from pdfleet_runtime.protocol.messages import IndicesModel, PromptFill, RankKey, RequestKind, TransferRequest

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    d = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["Simple is better than complex. Flat is better than nested. Ünïcode ✓"], trainer=trainer)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": TEMPLATE}))
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3_next", "eos_token_id": 0}))
    return d


def test_text_encodes_renders_chats_and_decodes(model_dir: Path) -> None:
    t = ModelText(model_dir)
    assert t.eos_ids == {0, 2}  # config.json's and the tokenizer's end token
    rendered = t.render_chat([ChatMessage(role="user", content="Hi")])
    assert rendered == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = t.encode(rendered)
    assert ids[0] == 1 and 2 in ids  # special tokens written in the text are matched
    assert t.decode(t.encode("Flat is better than nested.")) == "Flat is better than nested."
    bare = model_dir.parent / "bare"
    bare.mkdir()
    (bare / "config.json").write_text("{}")
    with pytest.raises(ModelTextError, match=r"tokenizer\.json"):
        ModelText(bare).encode("x")
    assert ModelText(bare).decode([1, 2]) == ""


def test_answer_cut_at_end_of_sequence_stop_string_or_length(model_dir: Path) -> None:
    t = ModelText(model_dir)
    body = t.encode("Simple is better than complex. Flat is better than nested.")
    c = completion_of((*body, 2, 5), t, (), 64)
    assert c.finish_reason == "stop" and c.ids == (*body, 2) and c.text == t.decode(body)
    assert len(c.tokens) == len(c.ids) and "".join(c.tokens) == c.text  # one piece per token, streaming
    c = completion_of(body, t, (), 3)
    assert c.finish_reason == "length" and c.ids == body[:3]
    c = completion_of(body, t, ("Flat",), 64)
    assert c.finish_reason == "stop" and c.text == "Simple is better than complex. "
    u = t.encode("Ünïcode ✓")
    c = completion_of(u, t, (), 64)
    assert c.text == "Ünïcode ✓" and "".join(c.tokens) == c.text and all("\ufffd" not in p for p in c.tokens)


@pytest.mark.parametrize(("field", "value"), [("temperature", 0.7), ("top_p", 0.9), ("top_k", 5), ("min_p", 0.1),
                                              ("frequency_penalty", 0.5), ("presence_penalty", 1.0),
                                              ("repetition_penalty", 1.2), ("logprobs", True), ("top_logprobs", 2)])
def test_sampling_that_is_not_greedy_is_refused(field: str, value: object) -> None:
    with pytest.raises(ApiError) as e:
        check_greedy({field: value})
    assert (e.value.status, e.value.code, e.value.param) == (400, "unsupported_sampling", field)


def test_greedy_equivalents_pass() -> None:
    for ok in ({}, {"temperature": 0}, {"temperature": 0.8, "top_k": 1}, {"top_p": 1.0}, {"top_k": -1},
               {"logprobs": False}, {"repetition_penalty": 1}):
        check_greedy(ok)


def test_prompt_ids_and_the_pools_bound(model_dir: Path) -> None:
    t = ModelText(model_dir)
    req = parse_request(Endpoint.CHAT, json.dumps({"messages": [{"role": "user", "content": "Hi"}], "seed": 3,
                                                   "stop": "x", "max_tokens": 8, "bootstrap_room": 1}).encode())
    out = prompt_of(req, t, 64)
    assert out.ids == t.encode(t.render_chat([ChatMessage(role="user", content="Hi")]))
    assert out.prompt_tokens == len(out.ids) and out.stop == ("x",) and out.ignored == ("seed",)
    with pytest.raises(ApiError) as e:
        prompt_of(req, t, len(out.ids) + 7)
    assert e.value.code == "context_length_exceeded"
    gen = parse_request(Endpoint.GENERATE, json.dumps({"input_ids": [5, 6], "sampling_params": {
        "temperature": 0.5}}).encode())
    with pytest.raises(ApiError, match="temperature"):
        prompt_of(gen, t, 64)


def test_a_claim_whose_prompt_is_not_the_rooms_is_refused() -> None:
    rooms = RoomTable(max_rooms=4, max_bytes=1 << 20, ttl_s=10, legs=1)
    rooms.hold(7, 1, 3, 100, prompt=(1, 2, 3))

    def claim(prompt: tuple[int, ...]) -> TransferRequest:
        return TransferRequest(request_id="room-7", instance="dec", kind=RequestKind.ROOM, room=7,
                               fill=PromptFill(prompt=prompt), dst=RankKey(tp=0, pp=0), indices=IndicesModel(),
                               timeout_s=10)

    with pytest.raises(ProtocolError, match="not the room's"):
        rooms.admit(claim((1, 2, 4)))
    admitted = rooms.admit(claim((1, 2, 3)))
    assert isinstance(admitted.fill, PromptFill) and admitted.fill.prompt == (1, 2, 3)


class _Resp:
    """What ``ModelStream`` writes to (an aiohttp ``StreamResponse``'s two calls)."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.ended = False

    async def write(self, data: bytes) -> None:
        self.events.append(data.decode())

    async def write_eof(self) -> None:
        self.ended = True


@pytest.mark.parametrize("endpoint", [Endpoint.CHAT, Endpoint.COMPLETIONS, Endpoint.GENERATE])
def test_a_stream_writes_each_token_once_and_never_past_a_stop_string(model_dir: Path, endpoint: Endpoint) -> None:
    import asyncio

    from pdfleet_runtime.pod.model_stream import ModelStream

    t = ModelText(model_dir)
    body = {"messages": [{"role": "user", "content": "Hi"}], "prompt": "x", "text": "x", "stop": ["Flat"], "bootstrap_room": 5,
            "stream": True}
    req = parse_request(endpoint, json.dumps(body).encode())
    ids = t.encode("Simple is better than complex. Flat is better than nested.")
    final = completion_of(ids, t, ("Flat",), 64)

    async def run() -> tuple[list[int], _Resp]:
        resp = _Resp()
        s = ModelStream(resp, req, t, model="m", created=1)  # type: ignore[arg-type]
        seen = []
        for i in range(1, len(ids) + 1):
            if await s.tokens(ids[:i]):
                break
            seen.append(len(resp.events))
        await s.finish(final, {})
        return seen, resp

    seen, resp = asyncio.run(run())
    assert resp.ended and seen[-1] > 0 and seen == sorted(seen)  # events went out before the end, in order
    assert "".join(resp.events) == "".join(sse_chunks(req, final, model="m", pdfleet={}, created=1))
    assert "Flat" not in "".join(resp.events)

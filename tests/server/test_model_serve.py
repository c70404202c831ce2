"""Model pods answer with the model's text (issue 45): ``serve`` prefill and decode pods computing the project's
trained Zen model (scripts/zen_model.py, a hybrid Qwen3-Next: GDN and full attention), driven as SGLang's router
drives PD workers, every answer checked against aggregate generation computed here with transformers from the
same model directory.

Covers: chat (the ``openai`` client, streaming and not), completions, SGLang's ``/generate``; greedy only
(sampling refused, OpenAI-shaped 400s); ``max_tokens`` (``length``), end of sequence and ``stop`` strings
(``stop``), real ``usage``; prefill and decode of different TP (2 -> 1, 1 -> 2); the canary checks tokens, so
every pair here is Ready only after a model canary equal to the prefill's aggregate; a decode that zeroes one
GDN recurrent slot of what it received fails that canary (not Ready) and answers differently from aggregate.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from pdfleet_runtime.config import ModelSourceConfig, RuntimeConfig
from pdfleet_runtime.layouts import LayoutRef
from pdfleet_runtime.model.hf_config import layout_for_model, read_config
from tests.server.harness import Pod, config, free_offset, http, metric
from tests.zen import Aggregate, zen_model_dir, zen_script

pytestmark = pytest.mark.slow

FAST = ("--retry-period", "0.3", "--canary-timeout", "10", "--canary-tokens", "32", "--floor-gbps", "0.0001")
MODEL = "zen"


@pytest.fixture(scope="module")
def zen() -> Path:
    return zen_model_dir()


@pytest.fixture(scope="module")
def aggregate(zen: Path) -> Aggregate:
    return Aggregate(zen)


def model_cfg(role: str, model_dir: Path, tp: int, peer_tp: int) -> RuntimeConfig:
    layout = layout_for_model(read_config(model_dir))
    base = config(role, tp=tp, peer_tp=peer_tp, requests=4, tokens=1024)
    return base.model_copy(update={"layout": LayoutRef(inline=layout), "model": ModelSourceConfig(path=model_dir),
                                   "served_model_name": MODEL})


class ModelPair:
    """A prefill and a decode pod of the model, and a router's way of sending them one request."""

    def __init__(self, tmp: Path, model_dir: Path, prefill_tp: int, decode_tp: int,
                 decode_args: tuple[str, ...] = (), prefill_args: tuple[str, ...] = ()) -> None:
        self.prefill = Pod(tmp, f"pre-{prefill_tp}", model_cfg("prefill", model_dir, prefill_tp, decode_tp),
                           offset=free_offset(), args=("--room-ttl", "30", *prefill_args))
        self.decode = Pod(tmp, f"dec-{decode_tp}", model_cfg("decode", model_dir, decode_tp, prefill_tp),
                          args=(*FAST, *decode_args), env={"PDFLEET_PREFILL_ADDRESSES": self.prefill.bootstrap})
        self.prefill.start()
        self.decode.start()

    def ready(self) -> ModelPair:
        self.decode.wait_ready(True, 180)
        return self

    def room(self) -> dict[str, Any]:
        host, port = self.prefill.bootstrap.split(":")
        return {"bootstrap_host": host, "bootstrap_port": int(port), "bootstrap_room": random.getrandbits(63)}

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.decode.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def send(self, path: str, body: dict[str, Any], decode_call: Any = None) -> tuple[tuple[int, Any], Any]:
        """The router's step: the same body to the prefill and the decode at once; the decode's answer (raw
        HTTP, or ``decode_call``'s)."""
        out: dict[str, Any] = {}
        t = threading.Thread(target=lambda: out.update(p=http("POST", self.prefill.url + path, body, 120)))
        t.start()
        try:
            dec = decode_call() if decode_call is not None else raw(self.decode.url + path, body)
        except openai.APIStatusError as e:
            dec = e
        t.join(130)
        return out["p"], dec

    def stop(self) -> None:
        self.decode.stop()
        self.prefill.stop()


def raw(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            text = r.read().decode()
            return r.status, json.loads(text) if not text.startswith("data:") else text
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())


@pytest.fixture
def pairs() -> Iterator[list[ModelPair]]:
    started: list[ModelPair] = []
    yield started
    for p in started:
        p.stop()


def chat(n: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": zen_script().QUESTION.format(n=n)}]


def test_zen_answers_through_pd_tp2_to_1_equal_aggregate(tmp_path: Path, zen: Path, aggregate: Aggregate,
                                                          pairs: list[ModelPair]) -> None:
    pair = ModelPair(tmp_path, zen, 2, 1)
    pairs.append(pair)
    pair.ready()
    client = pair.client()
    checked = differ = prompt_total = gen_total = 0
    t0 = time.monotonic()

    # Chat, not streaming: the question, answered as trained, token-exact with aggregate.
    for n in (3, 1, 11):
        body = {"model": MODEL, "messages": chat(n), "max_tokens": 64, **pair.room()}
        (pc, _), ans = pair.send("/v1/chat/completions", body, lambda b=body: client.chat.completions.create(
            model=MODEL, messages=b["messages"], max_tokens=64, extra_body={k: b[k] for k in b if
                                                                           k.startswith("bootstrap")}))
        assert pc == 200, ans
        ids = aggregate.chat_ids(chat(n))
        agg = aggregate.generate(ids, 64)
        got = ans.model_extra["pdfleet"]
        assert got["promptIds"] == ids  # the pod's tokenizer and chat template agree with transformers'
        checked += 1
        differ += got["outputIds"] != agg
        assert got["outputIds"] == agg, (n, got["outputIds"], agg)
        assert ans.choices[0].message.content == aggregate.text(agg) == zen_script().answer(n)
        assert ans.choices[0].finish_reason == "stop"
        assert (ans.usage.prompt_tokens, ans.usage.completion_tokens) == (len(ids), len(agg))
        assert ans.usage.total_tokens == len(ids) + len(agg)
        prompt_total, gen_total = prompt_total + len(ids), gen_total + len(agg)
    # Both roles count the model's tokens under SGLang's names (the decode: generated; the prefill: prompts).
    dec, pre = pair.decode.metrics(), pair.prefill.metrics()
    assert metric(dec, "sglang:generation_tokens_total", model_name=MODEL) == gen_total
    assert metric(dec, "sglang:time_to_first_token_seconds_count", model_name=MODEL) == 3
    assert metric(pre, "sglang:prompt_tokens_total", model_name=MODEL) == prompt_total
    # ... and under vLLM's (the pods speak its PD contract too), from the same calls.
    assert metric(dec, "vllm:generation_tokens_total", model_name=MODEL, engine="0") == gen_total
    assert metric(dec, "vllm:time_to_first_token_seconds_count", model_name=MODEL, engine="0") == 3
    itl = metric(dec, "vllm:inter_token_latency_seconds_count", model_name=MODEL, engine="0")
    assert itl > 0 and itl == metric(dec, "sglang:inter_token_latency_seconds_count", model_name=MODEL)
    assert metric(pre, "vllm:prompt_tokens_total", model_name=MODEL, engine="0") == prompt_total
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert dec[f"{name}{{engine=0,model_name={MODEL}}}"] == 0.0, name  # exported; nothing in flight now

    # Streaming through the openai client: one event per token, the text and usage as aggregate's.
    body = {"model": MODEL, "messages": chat(5), "max_tokens": 64, "stream": True,
            "stream_options": {"include_usage": True}, **pair.room()}
    (pc, _), stream = pair.send("/v1/chat/completions", body, lambda: client.chat.completions.create(
        model=MODEL, messages=body["messages"], max_tokens=64, stream=True, stream_options={"include_usage": True},
        extra_body={k: body[k] for k in body if k.startswith("bootstrap")}))
    assert pc == 200
    chunks = list(stream)
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content is not None]
    agg = aggregate.generate(aggregate.chat_ids(chat(5)), 64)
    assert "".join(deltas) == aggregate.text(agg) == zen_script().answer(5)
    assert len(deltas) == len(agg) + 1  # the role's empty delta, then one per token (the end token's is empty)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(agg)
    checked += 1

    # Completions: max_tokens cuts it (length); a stop string ends it (stop), the text before it.
    prompt = "Beautiful is better than ugly.\n"
    ids = aggregate.text_ids(prompt)
    agg = aggregate.generate(ids, 12)
    (pc, _), ans = pair.send("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 12, **pair.room()},
                             None)
    assert pc == 200 and ans[0] == 200, ans
    body = ans[1]
    assert body["pdfleet"]["outputIds"] == agg and body["choices"][0]["text"] == aggregate.text(agg)
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 12
    checked += 1
    full = aggregate.text(agg)
    stop = full.split()[2]
    (pc, _), ans = pair.send("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 12, "stop": [stop],
                                                 **pair.room()}, None)
    assert ans[0] == 200, ans
    assert ans[1]["choices"][0]["text"] == full[:full.index(stop)]
    assert ans[1]["choices"][0]["finish_reason"] == "stop"
    # The same through the openai client, streaming: the events never run past the stop string.
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "stop": [stop], "stream": True, **pair.room()}
    (pc, _), stream = pair.send("/v1/completions", body, lambda: client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, stop=[stop], stream=True,
        extra_body={k: body[k] for k in body if k.startswith("bootstrap")}))
    events = list(stream)
    assert "".join(e.choices[0].text for e in events if e.choices) == full[:full.index(stop)]
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] == "stop"

    # SGLang's /generate with input_ids.
    ids = aggregate.chat_ids(chat(7))
    agg = aggregate.generate(ids, 64)
    (pc, _), ans = pair.send("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 64,
                                                                                 "temperature": 0}, **pair.room()})
    assert ans[0] == 200, ans
    assert ans[1]["output_ids"] == agg and ans[1]["text"] == zen_script().answer(7)
    assert ans[1]["meta_info"]["finish_reason"]["type"] == "stop"
    checked += 1

    # Not greedy: refused before anything moves, OpenAI-shaped.
    for bad in ({"temperature": 0.7}, {"top_p": 0.5}, {"logprobs": True}):
        code, err = raw(pair.decode.url + "/v1/chat/completions", {"messages": chat(2), **bad, **pair.room()})
        assert code == 400 and err["error"]["code"] == "unsupported_sampling", err
        assert err["error"]["param"] == next(iter(bad))
    code, err = raw(pair.decode.url + "/v1/completions", {"prompt": prompt, "max_tokens": 1024, **pair.room()})
    assert code == 400 and err["error"]["code"] == "context_length_exceeded", err
    print(f"\nPD TP 2 -> 1: answers checked against aggregate {checked}, differ {differ} "
          f"({time.monotonic() - t0:.1f}s)")


def test_decode_fault_zeroing_a_recurrent_slot_fails_the_canary_and_answers_differ(tmp_path: Path, zen: Path, aggregate: Aggregate,
                                                                    pairs: list[ModelPair]) -> None:
    pair = ModelPair(tmp_path, zen, 1, 1, decode_args=("--fault-model", "gdn-slot-zeroed"))
    pairs.append(pair)
    # The canary checks tokens (the prefill's own aggregate continuation): this decode is never Ready.
    body = pair.decode.wait_ready(False, 180, until=lambda b: b.get("problem") == "BytesMismatched")
    assert "differs from the prefill's aggregate generation" in body["reason"], body
    differ = 0
    for n in (1, 3, 6, 9):
        ids = aggregate.chat_ids(chat(n))
        _, ans = pair.send("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 64},
                                               **pair.room()})
        differ += ans[0] != 200 or ans[1]["output_ids"] != aggregate.generate(ids, 64)
    assert differ > 0, "zeroing a GDN recurrent slot on the decode changed no answer: the check cannot fail"
    print(f"\ndecode fault gdn-slot-zeroed: {differ} of 4 answers differ from aggregate")


def test_decode_tp2_streams_generate_equal_to_aggregate(tmp_path: Path, zen: Path, aggregate: Aggregate,
                                                        pairs: list[ModelPair]) -> None:
    """PD TP 1 -> 2 (each decode rank's share from its own pools, gathered); SGLang's streaming /generate."""
    pair = ModelPair(tmp_path, zen, 1, 2)
    pairs.append(pair)
    pair.ready()
    for n in (2, 13):
        ids = aggregate.chat_ids(chat(n))
        agg = aggregate.generate(ids, 64)
        _, ans = pair.send("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 64}, "stream": True,
                                         **pair.room()})
        assert ans[0] == 200, ans
        events = [json.loads(x[len("data: "):]) for x in ans[1].split("\n\n") if x.startswith("data: {")]
        assert events[-1]["output_ids"] == agg and events[-1]["text"] == zen_script().answer(n)
        assert len(events) == len(agg) and events[-1]["meta_info"]["finish_reason"]["type"] == "stop"
    # The same answer from aggregate generation in a process of its own, as the demo checks it.
    out = subprocess.run([sys.executable, "-m", "pdfleet_runtime", "generate", "--aggregate", "--model", str(zen),
                          "--chat", zen_script().QUESTION.format(n=13), "--max-tokens", "64", "--json"],
                         capture_output=True, text=True, timeout=120, check=True)
    other = json.loads(out.stdout)
    ids = aggregate.chat_ids(chat(13))
    assert other["prompt_ids"] == ids and other["output_ids"] == aggregate.generate(ids, 64)
    assert other["text"] == zen_script().answer(13) and other["finish_reason"] == "stop"


def test_a_state_without_its_first_token_is_an_error_never_text(tmp_path: Path, zen: Path, aggregate: Aggregate,
                                                                pairs: list[ModelPair]) -> None:
    """A prefill that carries no first token (``first-token-lost``): the decode answers 500, no text."""
    pair = ModelPair(tmp_path, zen, 1, 1, prefill_args=("--fault-model", "first-token-lost"))
    pairs.append(pair)
    body = pair.decode.wait_ready(False, 180, until=lambda b: b.get("problem") == "BytesMismatched")
    assert "first tokens []" in body["reason"], body  # the canary needs the first token too: never Ready
    _, ans = pair.send("/v1/chat/completions", {"messages": chat(3), **pair.room()})
    assert ans[0] == 500 and ans[1]["error"]["code"] == "state_mismatch", ans
    assert "no first token" in ans[1]["error"]["message"] and "choices" not in ans[1]


def test_a_decode_drain_waits_for_the_answer_the_model_is_still_generating(tmp_path: Path, zen: Path,
                                                                         aggregate: Aggregate,
                                                                         pairs: list[ModelPair]) -> None:
    """CI, stop 53's tree: a model decode's drain finished once the state had arrived, while the model was still
    generating the answer; the pod was then deleted and the router retried the request. The generation now counts
    as in flight: the drain ends after the answer."""
    pair = ModelPair(tmp_path, zen, 1, 1)
    pairs.append(pair)
    pair.ready()
    body = {"model": MODEL, "messages": chat(7), "max_tokens": 64, **pair.room()}
    done: dict[str, Any] = {}

    def ask() -> None:
        (pc, _), ans = pair.send("/v1/chat/completions", body)
        done.update(prefill=pc, answer=ans, at=time.monotonic())

    asker = threading.Thread(target=ask)
    asker.start()
    room = f"room-{body['bootstrap_room']}"
    deadline = time.monotonic() + 120
    while not any(room in line and "success" in line for line in pair.decode.log().splitlines()):
        assert time.monotonic() < deadline and asker.is_alive(), pair.decode.log()[-2000:]
        time.sleep(0.02)
    code, drained = pair.decode.admin("POST", "/drain?wait=true", timeout_s=120)  # the state is here; tokens come
    drained_at = time.monotonic()
    asker.join(120)
    code_answer, answer = done["answer"]
    assert code == 200 and drained["drained"] and not drained["forced"], drained
    assert code_answer == 200 and done["prefill"] == 200, answer
    ids = aggregate.chat_ids(chat(7))
    assert answer["pdfleet"]["outputIds"] == aggregate.generate(ids, 64)
    assert drained_at >= done["at"] - 0.05, (drained_at, done["at"])  # the drain ended after the answer was sent

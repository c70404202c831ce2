"""Model pods whose model comes from the Hub (issue 47), through the node's weights cache: a prefill and a decode
started at once on one node fetch the commit once between them (one waits on the other's lock), load it and answer
as aggregate; a restarted pod loads it from the cache without downloading; a commit whose file the Hub serves with
another hash is never cached and the pod exits naming the file (a stand-in Hub on loopback)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from pdfleet_runtime.config import HubSourceConfig, ModelSourceConfig, RuntimeConfig
from pdfleet_runtime.model.hub_cache import snapshot_dir
from tests.hub_standin import MODEL as HUB_MODEL
from tests.hub_standin import A, B, Hub, running_hub
from tests.server.harness import Pod, free_offset
from tests.server.test_model_serve import FAST, chat, model_cfg, raw
from tests.zen import Aggregate, zen_model_dir

pytestmark = pytest.mark.slow

DOWNLOADED = "downloaded into the node's weights cache"
CACHED = "from the node's weights cache"


def hub_cfg(role: str, zen: Path, hub: Hub, cache: Path, commit: str) -> RuntimeConfig:
    source = HubSourceConfig(id=HUB_MODEL, commit=commit, endpoint=hub.endpoint, cache=cache)
    return model_cfg(role, zen, 1, 1).model_copy(update={
        "model": ModelSourceConfig(path=snapshot_dir(cache, HUB_MODEL, commit), hub=source)})


def test_a_nodes_pods_fetch_a_hub_commit_once_and_answer_as_aggregate(tmp_path: Path) -> None:
    zen = zen_model_dir()
    files = {p.relative_to(zen).as_posix(): p.read_bytes() for p in zen.rglob("*") if p.is_file()}
    cache = tmp_path / "node-weights"
    with running_hub() as hub:
        hub.files = {A: files, B: files}
        hub.file_delay_s = 0.3  # a fill of about 2 s: the two pods, started together, ask at once
        corrupt = bytearray(files["config.json"])
        corrupt[-2] ^= 1  # one bit of config.json, served for commit B instead of the listed bytes
        hub.served = {B: {"config.json": bytes(corrupt)}}
        prefill = Pod(tmp_path, "pre", hub_cfg("prefill", zen, hub, cache, A), offset=free_offset(),
                      args=("--room-ttl", "30"))
        decode = Pod(tmp_path, "dec", hub_cfg("decode", zen, hub, cache, A), args=FAST,
                     env={"PDFLEET_PREFILL_ADDRESSES": prefill.bootstrap})
        pods = [prefill, decode]
        try:
            prefill.start()
            decode.start()
            decode.wait_ready(True, 240)
            logs = {p.name: p.log() for p in pods}
            assert sorted(DOWNLOADED in log for log in logs.values()) == [False, True], logs
            assert sorted(CACHED in log for log in logs.values()) == [False, True], logs
            assert sorted(name for _, name in hub.downloads) == sorted(files)  # each file once, for both pods
            host, port = prefill.bootstrap.split(":")
            ids = (agg := Aggregate(zen)).chat_ids(chat(3))
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 32}, "bootstrap_host": host,
                    "bootstrap_port": int(port), "bootstrap_room": 7}
            t = threading.Thread(target=raw, args=(prefill.url + "/generate", body))
            t.start()
            code, ans = raw(decode.url + "/generate", body)
            t.join(60)
            assert code == 200 and ans["output_ids"] == agg.generate(ids, 32), ans

            decode.stop()  # restarted: loaded from the node's cache, nothing downloaded
            seen = len(hub.downloads)
            decode.start()
            decode.wait_ready(True, 240)
            assert CACHED in decode.log() and len(hub.downloads) == seen, decode.log()[-2000:]

            bad = Pod(tmp_path, "bad", hub_cfg("decode", zen, hub, cache, B), offset=free_offset())
            pods.append(bad)
            bad.start()
            assert bad.wait(120) == 1, bad.log()[-2000:]
            assert "config.json: git blob id" in bad.log() and "nothing was put in the cache" in bad.log()
            assert not snapshot_dir(cache, HUB_MODEL, B).exists()
        finally:
            for p in reversed(pods):
                p.stop()
    print(f"\nHub fetch: {len(files)} files, {sum(map(len, files.values()))} bytes; logs: "
          f"{[line for p in pods[:2] for line in p.log().splitlines() if 'weights cache' in line]}")

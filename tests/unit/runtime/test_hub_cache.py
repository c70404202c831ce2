"""The node's weights cache (model/hub_cache.py) against a Hub stand-in on loopback: one download per node and
commit, however many pods ask at once; nothing half-written or of another hash is ever used; the stand-in
answers as huggingface_hub itself reads the Hub (its own client downloads the same bytes)."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdfleet_runtime.config import HubSourceConfig, ModelSourceConfig
from pdfleet_runtime.model.digest import directory_digest
from pdfleet_runtime.model.hub_cache import (
    HubCacheError,
    evict,
    fill,
    git_blob_id,
    manifest_path,
    snapshot_dir,
)
from tests.hub_standin import MODEL, A, B, Hub, running_hub

FILES = {"config.json": b'{"model_type": "llama"}', "model.safetensors": os.urandom(300_000),
         "tokenizer/tokenizer.json": b'{"version": "1.0"}'}


@pytest.fixture
def hub() -> Iterator[Hub]:
    with running_hub() as h:
        h.files = {A: dict(FILES), B: dict(FILES, **{"config.json": b'{"model_type": "qwen3"}'})}
        yield h


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def hub_tree(root: Path, files: dict[str, bytes]) -> Path:
    """``files`` written under ``root``, as a path source would hold them."""
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def test_a_commit_is_downloaded_once_then_served_from_the_node_cache(hub: Hub, tmp_path: Path) -> None:
    first = fill(tmp_path, MODEL, A, hub.endpoint, token="hf_x")
    assert first.downloaded and first.files == 3 and first.bytes == sum(map(len, FILES.values()))
    assert first.path == snapshot_dir(tmp_path, MODEL, A) == tmp_path / "Org--Tiny-Model" / A
    assert _tree(first.path) == FILES  # the commit's files and nothing else: its digest is theirs
    assert directory_digest(first.path) == directory_digest(hub_tree(tmp_path / "plain", FILES))
    assert manifest_path(first.path).is_file()
    assert sorted(n for _, n in hub.downloads) == sorted(FILES)
    assert all(auth == "Bearer hf_x" for _, auth in hub.seen)
    again = fill(tmp_path, MODEL, A, hub.endpoint)  # a restarted pod, or a second pod of the node
    assert not again.downloaded and (again.files, again.bytes) == (first.files, first.bytes)
    assert len(hub.downloads) == 3 and len(hub.seen) == 4  # not even a listing
    assert "no download" in again.line(MODEL, A) and "downloaded" in first.line(MODEL, A)
    other = fill(tmp_path, MODEL, B, hub.endpoint)  # another commit is another directory
    assert other.downloaded and _tree(other.path)["config.json"] == b'{"model_type": "qwen3"}'
    assert _tree(first.path) == FILES


FILL = """
import sys, json
from pathlib import Path
from pdfleet_runtime.model.hub_cache import fill
r = fill(Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4])
print(json.dumps({"downloaded": r.downloaded}))
"""


def test_pods_that_ask_at_once_download_once(hub: Hub, tmp_path: Path) -> None:
    hub.file_delay_s = 0.7  # a fill takes 2 s: the three processes' fills overlap, as pods started together
    pods = [subprocess.Popen([sys.executable, "-c", FILL, str(tmp_path), MODEL, A, hub.endpoint],
                             stdout=subprocess.PIPE, text=True) for _ in range(3)]
    try:
        outs = [json.loads(p.communicate(timeout=60)[0]) for p in pods]
    finally:
        for p in pods:  # none outlives the test, should one hang
            p.kill()
            p.wait()
    assert [p.returncode for p in pods] == [0, 0, 0]
    assert sorted(o["downloaded"] for o in outs) == [False, False, True]
    assert len(hub.downloads) == 3
    assert _tree(snapshot_dir(tmp_path, MODEL, A)) == FILES


def test_a_file_whose_hash_differs_is_never_cached(hub: Hub, tmp_path: Path) -> None:
    bad = bytearray(FILES["model.safetensors"])
    bad[1000] ^= 1
    hub.served = {A: {"model.safetensors": bytes(bad)}}
    with pytest.raises(HubCacheError, match=r"model.safetensors: sha256 [0-9a-f]{64}, the Hub lists [0-9a-f]{64}"):
        fill(tmp_path, MODEL, A, hub.endpoint)
    assert not snapshot_dir(tmp_path, MODEL, A).exists()
    assert [p.name for p in (tmp_path / "Org--Tiny-Model").iterdir()] == []  # no partial directory left
    hub.served = {A: {"config.json": b'{"model_type": "llamb"}'}}  # same size, another git blob id
    with pytest.raises(HubCacheError, match=r"config\.json: git blob id"):
        fill(tmp_path, MODEL, A, hub.endpoint)
    hub.served = {}
    assert fill(tmp_path, MODEL, A, hub.endpoint).downloaded


def test_an_incomplete_snapshot_is_fetched_again(hub: Hub, tmp_path: Path) -> None:
    snap = fill(tmp_path, MODEL, A, hub.endpoint).path
    (snap / "model.safetensors").write_bytes(b"truncated")
    again = fill(tmp_path, MODEL, A, hub.endpoint)
    assert again.downloaded and _tree(snap) == FILES
    manifest_path(snap).unlink()  # killed between the rename and its manifest: never trusted
    assert fill(tmp_path, MODEL, A, hub.endpoint).downloaded


@pytest.mark.parametrize(("answer", "words"), [
    ((401, b""), "HTTP 401 (the token Secret is missing or wrong)"),
    ((404, b"{}"), "HTTP 404 (no such model or commit"),
    ((200, json.dumps({"sha": B, "siblings": []}).encode()), f"the Hub answered commit {B}, not {A}"),
    ((200, b"not json"), "not a revision with file hashes"),
    ((200, json.dumps({"sha": A, "siblings": [{"rfilename": "../../etc/x", "size": 1, "blobId": "0" * 40}]}).encode()),
     "leaves the model directory"),
])
def test_a_hub_that_answers_wrongly_is_named_and_leaves_nothing(hub: Hub, tmp_path: Path, answer: tuple[int, bytes],
                                                              words: str) -> None:
    hub.answer = answer
    with pytest.raises(HubCacheError, match=r"^http://127\.0\.0\.1:\d+/api/models/Org/Tiny-Model/revision/") as e:
        fill(tmp_path, MODEL, A, hub.endpoint)
    assert words in str(e.value)
    assert not (tmp_path / "Org--Tiny-Model" / A).exists() and not (tmp_path / "etc").exists()


def test_the_token_is_not_sent_to_the_host_a_file_is_redirected_to(hub: Hub, tmp_path: Path) -> None:
    with running_hub() as cdn:
        cdn.files = hub.files
        hub.redirect_to = cdn.endpoint  # another port: another host as far as the token is concerned
        assert fill(tmp_path, MODEL, A, hub.endpoint, token="hf_secret").downloaded
    assert sorted(n for _, n in cdn.downloads) == sorted(FILES) and hub.downloads == []
    assert {auth for _, auth in hub.seen} == {"Bearer hf_secret"}
    assert {auth for _, auth in cdn.seen} == {None}, cdn.seen


def test_a_killed_fills_partial_directory_is_removed_and_progress_is_said(hub: Hub, tmp_path: Path) -> None:
    stale = tmp_path / "Org--Tiny-Model" / f".partial-{A}-99999"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    hub.file_delay_s = 0.2
    said: list[str] = []
    fill(tmp_path, MODEL, A, hub.endpoint, progress_s=0.0, say=said.append)
    assert not stale.exists() and sorted(p.name for p in stale.parent.iterdir()) == [A, f"{A}.manifest.json"]
    assert said[0] == f"downloading {MODEL}@{A[:12]}: 3 files, {sum(map(len, FILES.values()))} bytes", said
    assert any(" of " in line and "bytes (" in line for line in said[1:]), said


def test_a_fill_held_by_another_pod_past_the_deadline_says_so(hub: Hub, tmp_path: Path) -> None:
    lock = tmp_path / ".locks" / f"Org--Tiny-Model@{A}"
    lock.parent.mkdir(parents=True)
    with lock.open("a") as fd:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(HubCacheError, match="another pod of this node held"):
            fill(tmp_path, MODEL, A, hub.endpoint, lock_timeout_s=0.5)
    assert hub.seen == []


def test_an_unreachable_hub_fails_within_the_deadline(tmp_path: Path) -> None:
    with pytest.raises(HubCacheError, match="is the Hub endpoint reachable"):
        fill(tmp_path, MODEL, A, "http://127.0.0.1:9", timeout_s=2)


HF_CLIENT = """
import json, sys
from huggingface_hub import HfApi, hf_hub_download
info = HfApi(endpoint=sys.argv[1]).model_info(sys.argv[2], revision=sys.argv[3], files_metadata=True)
out = {}
for s in info.siblings:
    path = hf_hub_download(sys.argv[2], s.rfilename, revision=sys.argv[3], cache_dir=sys.argv[4])
    out[s.rfilename] = {"size": s.size, "blob": s.blob_id, "lfs": s.lfs.sha256 if s.lfs else None,
                        "bytes": open(path, "rb").read().hex()}
print(json.dumps({"sha": info.sha, "files": out}))
"""


def test_the_stand_in_speaks_the_hub_api_as_huggingface_hub_reads_it(hub: Hub, tmp_path: Path) -> None:
    """huggingface_hub's own client (model_info with file metadata, hf_hub_download) against the stand-in, on
    loopback only, reads the sizes and hashes our fill checks and the bytes it cached."""
    env = dict(os.environ, HF_HUB_OFFLINE="0", HF_ENDPOINT=hub.endpoint, HF_HUB_DISABLE_TELEMETRY="1",
               HF_HUB_DISABLE_XET="1")
    got = subprocess.run([sys.executable, "-c", HF_CLIENT, hub.endpoint, MODEL, A, str(tmp_path / "hf")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr[-3000:]
    theirs = json.loads(got.stdout)
    assert theirs["sha"] == A
    ours = fill(tmp_path / "cache", MODEL, A, hub.endpoint).path
    assert sorted(theirs["files"]) == sorted(FILES)
    for name, f in theirs["files"].items():
        assert bytes.fromhex(f["bytes"]) == (ours / name).read_bytes() == FILES[name]
        assert f["size"] == len(FILES[name]) and f["blob"] == git_blob_id(ours / name)
        assert (f["lfs"] is not None) == name.endswith(".safetensors")


def test_the_config_keeps_the_model_path_where_the_cache_puts_the_commit(tmp_path: Path) -> None:
    hub = HubSourceConfig(id=MODEL, commit=A, endpoint="http://hub.local", cache=tmp_path)
    ok = ModelSourceConfig(path=snapshot_dir(tmp_path, MODEL, A), hub=hub)
    assert ok.hub is not None and ok.hub.commit == A
    with pytest.raises(ValueError, match=r"model.path /models/x is not where the weights cache keeps"):
        ModelSourceConfig(path=Path("/models/x"), hub=hub)
    with pytest.raises(ValueError, match="commit"):
        HubSourceConfig(id=MODEL, commit="main", endpoint="http://hub.local", cache=tmp_path)


HOLD = """
import sys, time
from pathlib import Path
from pdfleet_runtime.model.hub_cache import fill
fill(Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4])
print("HELD", flush=True)
time.sleep(120)
"""


def test_old_commits_no_pod_uses_are_evicted_and_those_in_use_are_kept(hub: Hub, tmp_path: Path) -> None:
    """A pod process holds its commit for its life: another pod's eviction skips it while it lives, keeps the
    newest other commit, and removes the rest manifest first (fetched again when asked for)."""
    pod = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path), MODEL, A, hub.endpoint],
                           stdout=subprocess.PIPE, text=True)
    try:
        assert pod.stdout is not None and pod.stdout.readline().strip() == "HELD"
        fill(tmp_path, MODEL, B, hub.endpoint)
        said: list[str] = []
        assert evict(tmp_path, MODEL, B, keep=0, say=said.append) == [] and not said  # A is the other pod's
        assert _tree(snapshot_dir(tmp_path, MODEL, A)) == FILES
    finally:
        pod.kill()
        pod.wait()
    assert evict(tmp_path, MODEL, B) == []  # the newest other commit is kept (a rollback's)
    assert evict(tmp_path, MODEL, B, keep=0, say=said.append) == [A]
    assert not snapshot_dir(tmp_path, MODEL, A).exists() and not manifest_path(snapshot_dir(tmp_path, MODEL, A)).exists()
    assert "removed Org/Tiny-Model@" in said[-1] and _tree(snapshot_dir(tmp_path, MODEL, B))["config.json"] == \
        b'{"model_type": "qwen3"}'
    assert evict(tmp_path, MODEL, B, keep=0) == []  # B is this process's own
    again = fill(tmp_path, MODEL, A, hub.endpoint)
    assert again.downloaded and _tree(again.path) == FILES

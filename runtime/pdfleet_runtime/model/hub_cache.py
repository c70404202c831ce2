"""A node's weights cache, filled from the Hugging Face Hub at one commit (issue 47).

A built-in runtime pod whose model comes from the Hub (``ModelSourceConfig.hub``) loads it from a directory the
node shares between its pods (a hostPath the user names), filled once per commit: the first pod of a node to
need a commit downloads it under a lock, every later pod of that node (a restart, a second pod) waits on the
lock and finds it complete, so nothing is downloaded twice. Nothing half-written is ever used: a commit is
downloaded into a temporary directory beside its place, each file is checked against the hash the Hub lists for
it at that commit (LFS files by their sha256, the others by their git blob id), and only then is the directory
renamed into place, and then its manifest is written beside it. A snapshot without its manifest (a fill
killed between the two), or with a file missing or of another size, is fetched again; a hash that does not
match fails the fill, naming the file and both hashes.

Layout: ``CACHE/ORG--NAME/COMMIT/`` (the model directory the ranks load: the commit's files and nothing else,
so ``pdfleet digest`` of it is the digest of those files), its manifest ``CACHE/ORG--NAME/COMMIT.manifest.json``,
its fill lock ``CACHE/.locks/ORG--NAME@COMMIT`` and its use lock ``CACHE/.locks/ORG--NAME@COMMIT.use``.

Old commits go (``evict``): every pod process holds its commit's use lock shared for its whole life (taken under
the fill lock, so nothing can remove the commit between the check and the hold). After its fill, a pod removes
each other commit of its model that no pod of the node holds, except the ``KEEP_OTHER_COMMITS`` newest (a
rollback's), each removal logged: manifest first, so a removal cut short leaves a snapshot that is fetched again.
The Hub's own API, as ``huggingface_hub`` reads it: ``GET {endpoint}/api/models/{id}/revision/{commit}?blobs=true``
lists the files with their sizes and hashes, ``GET {endpoint}/{id}/resolve/{commit}/{file}`` gives each one.
Standard library only (the pod process runs it before its ranks start); every request has a deadline.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
import urllib.response
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import IO, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pdfleet_runtime.model.digest import hash_file

__all__ = ["KEEP_OTHER_COMMITS", "FillReport", "HubCacheError", "HubFile", "evict", "fill", "git_blob_id",
           "manifest_path", "snapshot_dir"]

MANIFEST_SUFFIX = ".manifest.json"
KEEP_OTHER_COMMITS = 1
"""Commits of a model no pod of the node uses that ``evict`` keeps besides the one being used (the newest, by
their manifests' times): a rollback to the commit before finds it on the node."""
_HELD: list[IO[str]] = []
"""The use locks this process holds (shared, until it exits): ``fill`` adds its commit's."""
_CHUNK = 1 << 20


class HubCacheError(RuntimeError):
    """The cache cannot hold the commit: the Hub refused or answered wrongly, a file's hash differs, the lock
    was not had in time. The message names the model, the commit and the fix."""


class _Lfs(BaseModel):
    model_config = ConfigDict(extra="ignore")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int = Field(ge=0)


class HubFile(BaseModel):
    """One file of a commit as the Hub lists it (``siblings`` with ``blobs=true``)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    rfilename: str = Field(min_length=1, max_length=1024)
    size: int = Field(ge=0)
    blob_id: str = Field(alias="blobId", pattern=r"^[0-9a-f]{40}$")
    lfs: _Lfs | None = None

    def relative(self) -> PurePosixPath:
        """The file's path under the snapshot; refuses one that would leave it."""
        p = PurePosixPath(self.rfilename)
        if p.is_absolute() or ".." in p.parts or p.name in ("", "."):
            raise ValueError(f"the Hub listed a file path {self.rfilename!r} that leaves the model directory")
        return p


class _Revision(BaseModel):
    model_config = ConfigDict(extra="ignore")
    sha: str = Field(pattern=r"^[0-9a-f]{40}$")
    siblings: list[HubFile] = Field(max_length=100_000)


class FillReport(BaseModel):
    """What filling the cache did, for the pod's start log."""

    path: Path
    downloaded: bool = Field(description="False: the commit was in the node's cache already.")
    files: int
    bytes: int
    waited_s: float = Field(description="Seconds spent waiting for another pod's fill (the lock).")
    seconds: float = Field(description="Seconds downloading and checking.")

    def line(self, model: str, commit: str) -> str:
        if not self.downloaded:
            return (f"model {model}@{commit[:12]} from the node's weights cache {self.path} (no download; {self.files} "
                    f"files, {self.bytes} bytes; waited {self.waited_s:.1f}s for the lock)")
        return (f"model {model}@{commit[:12]} downloaded into the node's weights cache {self.path}: {self.files} "
                f"files, {self.bytes} bytes in {self.seconds:.1f}s (waited {self.waited_s:.1f}s for the lock)")


def snapshot_dir(cache: Path, model: str, commit: str) -> Path:
    """Where ``model`` at ``commit`` lives in the cache (``ORG--NAME/COMMIT``)."""
    return cache / model.replace("/", "--") / commit


def manifest_path(snap: Path) -> Path:
    """The manifest of the snapshot ``snap``, beside it (``COMMIT.manifest.json``): written last, so its presence
    says the snapshot is whole."""
    return snap.with_name(snap.name + MANIFEST_SUFFIX)


def git_blob_id(path: Path) -> str:
    """The git blob id (sha1 of ``blob SIZE\\0`` and the content) the Hub lists for a non-LFS file."""
    return hash_file(hashlib.sha1(f"blob {path.stat().st_size}\0".encode(), usedforsecurity=False), path).hexdigest()


def _complete(snap: Path) -> tuple[int, int] | None:
    """(files, bytes) of a snapshot whose manifest holds and whose files are all there at their sizes."""
    try:
        listed = [HubFile.model_validate(f) for f in json.loads(manifest_path(snap).read_text())["files"]]
        for f in listed:
            if (snap / f.relative()).stat().st_size != f.size:
                return None
    except (OSError, ValueError, KeyError, TypeError, ValidationError):
        return None
    return len(listed), sum(f.size for f in listed)


@contextlib.contextmanager
def _locked(path: Path, timeout_s: float, say: Callable[[str], None]) -> Iterator[float]:
    """Hold ``path``'s exclusive lock (another pod of the node may be filling the same commit); yields the wait."""
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with path.open("a") as fd:
        said = 0.0
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - t0
                if waited > timeout_s:
                    raise HubCacheError(f"another pod of this node held {path} for {timeout_s:.0f}s: its fill of the "
                                        f"same commit is stuck or slow (see that pod's log; a dead pod's lock is "
                                        f"released with it)") from None
                if waited - said >= 30:
                    say(f"waiting for another pod's fill of this commit ({waited:.0f}s, lock {path})")
                    said = waited
                time.sleep(0.2)
        try:
            yield time.monotonic() - t0
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)


class _TokenStaysHome(urllib.request.HTTPRedirectHandler):
    """Follow the Hub's redirects (its large files are served from another host), never taking the token along
    to another host."""

    def redirect_request(self, req: urllib.request.Request, fp: Any, code: int, msg: str, headers: Any,
                         newurl: str) -> urllib.request.Request | None:
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and urllib.parse.urlsplit(newurl).netloc != urllib.parse.urlsplit(req.full_url).netloc:
            new.remove_header("Authorization")
        return new


class _Hub:
    """The Hub's revision and resolve endpoints, with a token and a deadline per request."""

    def __init__(self, endpoint: str, model: str, commit: str, token: str | None, timeout_s: float) -> None:
        self.base, self.model, self.commit = endpoint.rstrip("/"), model, commit
        self.headers = {"User-Agent": "pdfleet-runtime"} | ({"Authorization": f"Bearer {token}"} if token else {})
        self.timeout_s = timeout_s
        self.opener = urllib.request.build_opener(_TokenStaysHome)

    def _open(self, url: str) -> urllib.response.addinfourl:
        try:
            r: urllib.response.addinfourl = self.opener.open(
                urllib.request.Request(url, headers=self.headers), timeout=self.timeout_s)
            return r
        except urllib.error.HTTPError as e:
            hint = {401: "the token Secret is missing or wrong", 403: "the token may not read this model",
                    404: "no such model or commit on this Hub"}.get(e.code, "the Hub refused")
            raise HubCacheError(f"{url}: HTTP {e.code} ({hint})") from None
        except (urllib.error.URLError, OSError) as e:
            raise HubCacheError(f"{url}: {e} (is the Hub endpoint reachable from this pod?)") from None

    def files(self) -> list[HubFile]:
        url = (f"{self.base}/api/models/{urllib.parse.quote(self.model)}/revision/{self.commit}?blobs=true")
        with self._open(url) as r:
            raw = r.read(64 << 20)
        try:
            rev = _Revision.model_validate_json(raw)
            for f in rev.siblings:
                f.relative()
        except (ValidationError, ValueError) as e:
            raise HubCacheError(f"{url}: not a revision with file hashes the Hub's API gives: {e}") from None
        if rev.sha != self.commit:
            raise HubCacheError(f"{url}: the Hub answered commit {rev.sha}, not {self.commit}")
        return rev.siblings

    def download(self, f: HubFile, dest: Path, progress: Callable[[int], None]) -> None:
        url = (f"{self.base}/{urllib.parse.quote(self.model)}/resolve/{self.commit}/"
               f"{urllib.parse.quote(f.rfilename)}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        got = 0
        with self._open(url) as r, dest.open("wb") as out:
            while chunk := r.read(_CHUNK):
                got += len(chunk)
                if got > f.size:
                    raise HubCacheError(f"{url}: more than the {f.size} bytes the Hub listed for {f.rfilename}")
                out.write(chunk)
                progress(len(chunk))
        if got != f.size:
            raise HubCacheError(f"{url}: {got} bytes, the Hub listed {f.size} for {f.rfilename}")


def _check(f: HubFile, path: Path) -> None:
    if f.lfs is not None:
        got, want, kind = hash_file(hashlib.sha256(), path).hexdigest(), f.lfs.sha256, "sha256"
    else:
        got, want, kind = git_blob_id(path), f.blob_id, "git blob id"
    if got != want:
        raise HubCacheError(f"{f.rfilename}: {kind} {got}, the Hub lists {want} for it at this commit (a proxy or "
                            f"mirror changed it, or the download was corrupted); nothing was put in the cache")


def _lock_path(cache: Path, snap: Path) -> Path:
    return cache / ".locks" / f"{snap.parent.name}@{snap.name}"


def _use_path(cache: Path, snap: Path) -> Path:
    return cache / ".locks" / f"{snap.parent.name}@{snap.name}.use"


def _hold(cache: Path, snap: Path) -> None:
    """This process uses ``snap`` until it exits: its use lock, shared (``evict`` takes it exclusive to remove)."""
    fd = _use_path(cache, snap).open("a")
    fcntl.flock(fd, fcntl.LOCK_SH)
    _HELD.append(fd)


def evict(cache: Path, model: str, using: str, *, keep: int = KEEP_OTHER_COMMITS,
          say: Callable[[str], None] = lambda _m: None) -> list[str]:
    """Remove the commits of ``model`` in ``cache`` that no process holds (its use lock taken exclusive, without
    waiting), except ``using`` and the ``keep`` newest of the others; the commits removed. A commit being filled
    or used is skipped; an error removing one is said and the others go on."""
    root = snapshot_dir(cache, model, using).parent
    others = []
    for snap in root.iterdir() if root.is_dir() else ():
        if snap.is_dir() and snap.name != using and not snap.name.startswith("."):
            try:
                others.append((manifest_path(snap).stat().st_mtime, snap))
            except OSError:
                others.append((0.0, snap))  # no manifest: a removal or a fill cut short, never whole
    removed = []
    for _, snap in sorted(others, reverse=True)[keep:]:
        try:
            with _use_path(cache, snap).open("a") as use, _lock_path(cache, snap).open("a") as fill_lock:
                try:
                    fcntl.flock(use, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    fcntl.flock(fill_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a pod of this node uses it, or is filling it
                manifest_path(snap).unlink(missing_ok=True)  # first: from here on the snapshot is not whole
                shutil.rmtree(snap)
            removed.append(snap.name)
            say(f"removed {model}@{snap.name[:12]} from the node's weights cache {root} (no pod of the node uses it;"
                f" the {keep} newest other commit(s) are kept)")
        except OSError as e:
            say(f"could not remove {model}@{snap.name[:12]} from the node's weights cache: {e}")
    return removed


def fill(cache: Path, model: str, commit: str, endpoint: str, *, token: str | None = None,
         timeout_s: float = 60.0, lock_timeout_s: float = 3600.0, progress_s: float = 30.0,
         say: Callable[[str], None] = lambda _m: None) -> FillReport:
    """Make ``snapshot_dir(cache, model, commit)`` hold the commit's files, downloading only if the node's cache
    lacks it (``say`` gets a progress line every ``progress_s``), and hold it for this process's life (its use
    lock). Raises ``HubCacheError``; whatever fails leaves the cache as it was."""
    snap = snapshot_dir(cache, model, commit)
    lock = _lock_path(cache, snap)
    t0 = time.monotonic()
    with _locked(lock, lock_timeout_s, say) as waited:
        _hold(cache, snap)  # under the fill lock: no eviction between the check below and the use
        if (have := _complete(snap)) is not None:
            return FillReport(path=snap, downloaded=False, files=have[0], bytes=have[1], waited_s=waited,
                              seconds=time.monotonic() - t0 - waited)
        hub = _Hub(endpoint, model, commit, token, timeout_s)
        files = hub.files()
        snap.parent.mkdir(parents=True, exist_ok=True)
        for stale in snap.parent.glob(f".partial-{commit}-*"):  # a killed fill's (the lock is ours now)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = snap.parent / f".partial-{commit}-{os.getpid()}"
        try:
            total = sum(f.size for f in files)
            say(f"downloading {model}@{commit[:12]}: {len(files)} files, {total} bytes")
            done, said = 0, time.monotonic()

            def progress(n: int) -> None:
                nonlocal done, said
                done += n
                if time.monotonic() - said >= progress_s:
                    said = time.monotonic()
                    say(f"downloading {model}@{commit[:12]}: {done} of {total} bytes "
                        f"({said - t0 - waited:.0f}s)")

            for f in files:
                dest = tmp / f.relative()
                hub.download(f, dest, progress)
                _check(f, dest)
            manifest = manifest_path(snap)
            manifest.unlink(missing_ok=True)  # an earlier fill's, of a snapshot found incomplete
            if snap.exists():  # an incomplete snapshot of an earlier fill: replaced whole
                shutil.rmtree(snap)
            tmp.rename(snap)
            pending = manifest.with_name(f".{manifest.name}.{os.getpid()}")
            pending.write_text(json.dumps(
                {"model": model, "commit": commit, "files": [f.model_dump(by_alias=True) for f in files]}))
            pending.rename(manifest)  # last: the snapshot is whole from here on
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return FillReport(path=snap, downloaded=True, files=len(files), bytes=total, waited_s=waited,
                          seconds=time.monotonic() - t0 - waited)

"""A stand-in of the Hugging Face Hub on loopback (no network), answering as ``huggingface_hub`` reads the Hub:
``/api/models/{id}/revision/{ref}`` -> ``{"id", "sha"}`` (an unknown ref is 404), with ``siblings`` when the
commit has files (``?blobs=true``: each file's size and git blob id, and ``lfs.sha256`` for LFS files), and
``/{id}/resolve/{ref}/{file}`` (GET and HEAD) with the Hub's ``X-Repo-Commit``, ``ETag`` and, for LFS files,
``X-Linked-Etag`` and ``X-Linked-Size`` headers. It records the requests it saw and the files it served."""

from __future__ import annotations

import hashlib
import json
import threading
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

A, B = "a" * 40, "0123456789abcdef0123456789abcdef01234567"
MODEL = "Org/Tiny-Model"


def blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


class Hub:
    """The Hub's revision and resolve APIs: refs -> commits, commits -> files, the requests it saw."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.refs: dict[str, str] = {"main": A, "v2": B}
        self.files: dict[str, dict[str, bytes]] = {}
        """commit -> {path: content}: what the commit holds (listed and served)."""
        self.served: dict[str, dict[str, bytes]] = {}
        """commit -> {path: content} served instead of the listed content (a corrupting proxy)."""
        self.seen: list[tuple[str, str | None]] = []
        self.downloads: list[tuple[str, str]] = []
        """(commit, path) of every GET of a file."""
        self.answer: tuple[int, bytes] | None = None
        self.redirect_to: str | None = None
        """Answer each file with a 302 to this other server, same path (the Hub sends large files to a CDN)."""
        self.file_delay_s = 0.0
        """Seconds each file's GET waits before answering (a slow Hub: fills that overlap)."""
        self.delay = threading.Event()
        hub = self

        class H(BaseHTTPRequestHandler):
            def do_HEAD(self) -> None:
                self._answer(head=True)

            def do_GET(self) -> None:
                self._answer(head=False)

            def _answer(self, head: bool) -> None:
                hub.seen.append((self.path, self.headers.get("Authorization")))
                if hub.answer is not None:
                    code, body = hub.answer
                    if code == 599:
                        hub.delay.wait(5)
                        return
                    return self._send(code, body, {"Content-Type": "application/json"}, head)
                url = urllib.parse.urlsplit(self.path)
                path = urllib.parse.unquote(url.path)
                revision = f"/api/models/{MODEL}/revision/"
                resolve = f"/{MODEL}/resolve/"
                if path.startswith(revision):
                    sha = hub.commit_of(path[len(revision):])
                    if sha is None:
                        return self._send(404, b"{}", {"Content-Type": "application/json"}, head)
                    blobs = urllib.parse.parse_qs(url.query).get("blobs") == ["true"]
                    return self._send(200, json.dumps(hub.revision(sha, blobs)).encode(),
                                      {"Content-Type": "application/json"}, head)
                if path.startswith(resolve) and hub.redirect_to is not None:
                    return self._send(302, b"", {"Location": hub.redirect_to + self.path}, head)
                if path.startswith(resolve):
                    ref, _, name = path[len(resolve):].partition("/")
                    sha = hub.commit_of(ref)
                    if sha is None or name not in hub.files.get(sha, {}):
                        return self._send(404, b"", {"X-Error-Code": "EntryNotFound"}, head)
                    listed = hub.files[sha][name]
                    body = hub.served.get(sha, {}).get(name, listed)
                    headers = {"X-Repo-Commit": sha, "ETag": f'"{blob_id(listed)}"',
                               "Content-Type": "application/octet-stream"}
                    if hub.is_lfs(name):
                        headers |= {"X-Linked-Etag": f'"{hashlib.sha256(listed).hexdigest()}"',
                                    "X-Linked-Size": str(len(listed))}
                    if not head:
                        hub.downloads.append((sha, name))
                        hub.delay.wait(hub.file_delay_s)
                    return self._send(200, body, headers, head)
                self._send(404, b"{}", {"Content-Type": "application/json"}, head)

            def _send(self, code: int, body: bytes, headers: dict[str, str], head: bool) -> None:
                self.send_response(code)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def log_message(self, *_: Any) -> None:
                pass

        self.server = ThreadingHTTPServer((host, 0), H)
        self.endpoint = f"http://{host}:{self.server.server_address[1]}"

    def commit_of(self, ref: str) -> str | None:
        """A ref's commit, or the commit itself when it is one the Hub holds."""
        if ref in self.refs:
            return self.refs[ref]
        return ref if ref in self.files or ref in self.refs.values() else None

    @staticmethod
    def is_lfs(name: str) -> bool:
        return name.endswith((".safetensors", ".bin"))

    def revision(self, sha: str, blobs: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"id": MODEL, "modelId": MODEL, "sha": sha}
        if sha in self.files:
            siblings = []
            for name, data in sorted(self.files[sha].items()):
                s: dict[str, Any] = {"rfilename": name}
                if blobs:
                    s |= {"size": len(data), "blobId": blob_id(data)}
                    if self.is_lfs(name):
                        s["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
                siblings.append(s)
            body["siblings"] = siblings
        return body


@contextmanager
def running_hub(host: str = "127.0.0.1") -> Iterator[Hub]:
    """The stand-in on ``host`` (loopback; a test of the local cluster: the node's address on the pod bridge)."""
    h = Hub(host)
    t = threading.Thread(target=h.server.serve_forever, daemon=True)
    t.start()
    try:
        yield h
    finally:
        h.delay.set()
        h.server.shutdown()
        h.server.server_close()

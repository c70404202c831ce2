"""A stand-in of the Hugging Face Hub's revision API on loopback (no network): refs -> commits, and the
requests it saw (``/api/models/{id}/revision/{ref}`` -> ``{"sha": COMMIT}``; an unknown ref is 404)."""

from __future__ import annotations

import json
import threading
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

A, B = "a" * 40, "0123456789abcdef0123456789abcdef01234567"
MODEL = "Org/Tiny-Model"


class Hub:
    """The Hub's ``/api/models/{id}/revision/{ref}``: refs -> commits, the requests it saw."""

    def __init__(self) -> None:
        self.refs: dict[str, str] = {"main": A, "v2": B}
        self.seen: list[tuple[str, str | None]] = []
        self.answer: tuple[int, bytes] | None = None
        self.delay = threading.Event()
        hub = self

        class H(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                hub.seen.append((self.path, self.headers.get("Authorization")))
                if hub.answer is not None:
                    code, body = hub.answer
                else:
                    prefix = f"/api/models/{MODEL}/revision/"
                    ref = self.path[len(prefix):] if self.path.startswith(prefix) else None
                    sha = hub.refs.get(urllib.parse.unquote(ref or ""))
                    code, body = (200, json.dumps({"id": MODEL, "sha": sha}).encode()) if sha else (404, b"{}")
                if code == 599:
                    hub.delay.wait(5)
                    return
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"


@contextmanager
def running_hub() -> Iterator[Hub]:
    h = Hub()
    t = threading.Thread(target=h.server.serve_forever, daemon=True)
    t.start()
    try:
        yield h
    finally:
        h.delay.set()
        h.server.shutdown()
        h.server.server_close()

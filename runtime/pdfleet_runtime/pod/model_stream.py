"""A model pod's streaming answer: server-sent events written as decode rank 0 computes each token.

The events are ``worker_api.sse_chunks``'s for the completion so far (``model_answer.completion_of``), so a
stream carries exactly the events of the whole answer, one per token. The last token's event waits for the
next token (SGLang's ``/generate`` puts the finish on it), and so does any token whose text a stop string
found later could still cut (a match ends in new text, so it starts within the longest stop string's length
minus one of the end): nothing sent is ever taken back. A continuation that
fails after the first event ends the stream with an OpenAI-shaped error event, never more text.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from .model_answer import completion_of
from .model_text import ModelText
from .worker_api import ApiError, Completion, Endpoint, WorkerRequest, error_body, sse_chunks

__all__ = ["ModelStream"]


class ModelStream:
    """The events of one streaming model request, written to ``resp`` as its tokens arrive."""

    def __init__(self, resp: web.StreamResponse, req: WorkerRequest, text: ModelText, *, model: str,
                 created: int) -> None:
        self.resp, self.req, self.text, self.model, self.created = resp, req, text, model, created
        self.sent = 0
        self.margin = max((len(s) for s in req.stop), default=1) - 1
        """Characters at the text's end a stop string found later could still cut (one shorter than the longest)."""
        self.lead = 1 if req.endpoint is Endpoint.CHAT else 0  # the role's event comes first in a chat

    async def tokens(self, ids: tuple[int, ...]) -> bool:
        """The continuation so far: write the events no later token can change; True once it stopped (an end
        token or a stop string: the rest is not awaited)."""
        c = completion_of(ids, self.text, self.req.stop, self.req.max_tokens)
        await self._write(c, {}, final=False)
        return c.finish_reason == "stop"

    async def finish(self, c: Completion, pdfleet: dict[str, Any]) -> None:
        """The whole answer: the events not yet written, its finish, (asked for) its usage, ``[DONE]``."""
        await self._write(c, pdfleet, final=True)
        await self.resp.write_eof()

    async def fail(self, e: ApiError) -> None:
        """The stream started, then the continuation failed: an error event, ``[DONE]``, no more text."""
        await self.resp.write(f"data: {json.dumps(error_body(e))}\n\n".encode())
        await self.resp.write(b"data: [DONE]\n\n")
        await self.resp.write_eof()

    async def _write(self, c: Completion, pdfleet: dict[str, Any], *, final: bool) -> None:
        events = sse_chunks(self.req, c, model=self.model, pdfleet=pdfleet, created=self.created)
        upto = len(events)
        if not final:  # every token but the last whose text ends before what a stop string could still cut
            safe, end, k = len(c.text) - self.margin, 0, 0
            for piece in c.tokens[:-1]:
                if end + len(piece) > safe:
                    break
                end, k = end + len(piece), k + 1
            upto = max(self.sent, self.lead + k)
        for event in events[self.sent:upto]:
            await self.resp.write(event.encode())
        self.sent = max(self.sent, upto)

"""A model directory's text side in the pod process: tokenizer, chat template, end of sequence (never torch).

A reference-engine pod (``RuntimeConfig.model``) answers with the model's text, so both roles turn a body into
the same prompt ids and the decode turns its tokens back into text. transformers' ``AutoTokenizer`` imports
torch, which the pod process never does; the directory's ``tokenizer.json`` is read with the ``tokenizers``
library and the chat template of ``tokenizer_config.json`` rendered with jinja2's sandbox, as transformers
renders it (``messages``, ``add_generation_prompt``, the special tokens by name). Both roles run this same
code on the same body, so they agree on the ids without talking; a claim whose ids differ from the room's is
refused (``rooms.RoomTable.admit``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

__all__ = ["ModelText", "ModelTextError", "load_model_text"]

MAX_FILE_BYTES = 64 << 20
"""Largest tokenizer.json (or config) read: a real vocabulary is a few MiB."""


class ModelTextError(ValueError):
    """The model directory has no usable tokenizer or chat template; the message names the file and the fix."""


class ChatMessage(BaseModel):
    """One message as the chat template reads it."""

    model_config = ConfigDict(frozen=True)

    role: str
    content: str


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    if path.stat().st_size > MAX_FILE_BYTES:
        raise ModelTextError(f"{path} is larger than {MAX_FILE_BYTES} bytes")
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ModelTextError(f"{path} is not a JSON object")
    return data


def _token_name(v: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an object with its ``content``."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


class ModelText:
    """Encode, render chats, decode, and the ids that end a sequence, for one model directory."""

    def __init__(self, model_dir: Path) -> None:
        from tokenizers import Tokenizer

        d = Path(model_dir)
        tok_file = d / "tokenizer.json"
        self.tokenizer: Tokenizer | None = None
        """None without tokenizer.json: only token ids are taken then, and answered as ids with no text."""
        if tok_file.is_file():
            if tok_file.stat().st_size > MAX_FILE_BYTES:
                raise ModelTextError(f"{tok_file} is larger than {MAX_FILE_BYTES} bytes")
            self.tokenizer = Tokenizer.from_file(str(tok_file))
        tc, cfg = _json(d / "tokenizer_config.json"), _json(d / "config.json")
        self.template_source: str | None = tc.get("chat_template") if isinstance(tc.get("chat_template"), str) else None
        self.specials = {k: name for k in ("bos_token", "eos_token", "pad_token", "unk_token")
                         if (name := _token_name(tc.get(k))) is not None}
        eos: set[int] = set()
        raw = cfg.get("eos_token_id")
        for x in raw if isinstance(raw, list) else [raw]:
            if isinstance(x, int):
                eos.add(x)
        name = self.specials.get("eos_token")
        if self.tokenizer is not None and name is not None and (i := self.tokenizer.token_to_id(name)) is not None:
            eos.add(i)
        self.eos_ids = frozenset(eos)
        """Token ids that end a completion (``finish_reason`` ``stop``): config.json's and the tokenizer's."""
        self._template: Any = None

    def encode(self, text: str) -> tuple[int, ...]:
        """``text`` as ids, no special tokens added (special tokens written in the text are matched)."""
        if self.tokenizer is None:
            raise ModelTextError("the model directory has no tokenizer.json: send token ids (/v1/completions with a "
                                 "list of ids, /generate with input_ids), or add the tokenizer files")
        return tuple(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Ids as text, special tokens left out (as an OpenAI answer's content); empty without a tokenizer."""
        if self.tokenizer is None:
            return ""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def render_chat(self, messages: Sequence[ChatMessage]) -> str:
        """The chat template applied with ``add_generation_prompt`` (what transformers' ``apply_chat_template``
        renders); ``ModelTextError`` without a template."""
        if self.template_source is None:
            raise ModelTextError("the model's tokenizer_config.json has no chat_template: send /v1/completions "
                                 "with a prompt instead")
        if self._template is None:
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise ModelTextError(f"the chat template refused the messages: {message}")

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
            env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
            env.globals["raise_exception"] = raise_exception
            try:
                self._template = env.from_string(self.template_source)
            except Exception as e:  # jinja2's TemplateSyntaxError and kin: the directory's fault
                raise ModelTextError(f"the chat template of tokenizer_config.json does not parse: {e}") from None
        try:
            return str(self._template.render(messages=[m.model_dump() for m in messages], add_generation_prompt=True,
                                             **self.specials))
        except ModelTextError:
            raise
        except Exception as e:  # a template error on these messages (jinja2's UndefinedError, SecurityError...)
            raise ModelTextError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from None


def load_model_text(model_dir: Path) -> ModelText:
    return ModelText(model_dir)

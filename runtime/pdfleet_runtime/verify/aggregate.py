"""Aggregate generation in a process of its own (``pdfleet-runtime generate --aggregate``): what a model pod's answer
must equal, computed without PD by transformers from the same model directory.

The demo and end-to-end checks start it as a separate process, so the operator's and the CLI's processes never
import torch. The prompt's ids come from transformers' own tokenizer and chat template (an independent check of
the pods' ``tokenizers`` + jinja2 encoding), the continuation from transformers' greedy ``generate``, ending
after the model's end-of-sequence token (kept, as the pods count it) or ``max_tokens``. One torch thread.
"""

from __future__ import annotations

import os
from pathlib import Path

from pdfleet_runtime.model.aggregate_answer import AggregateAnswer

__all__ = ["AggregateAnswer", "aggregate_answer"]


def aggregate_answer(model_dir: Path, *, chat: str | None = None, prompt: str | None = None,
                     prompt_ids: list[int] | None = None, max_tokens: int = 64) -> AggregateAnswer:
    """One prompt (a user message rendered with the chat template, a text, or ids), answered greedily."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoTokenizer

    from pdfleet_runtime.rank.model_runner import load_model

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)
    model, _raw = load_model(model_dir)
    if chat is not None:
        text = tok.apply_chat_template([{"role": "user", "content": chat}], tokenize=False, add_generation_prompt=True)
        ids = list(tok(text, add_special_tokens=False)["input_ids"])
    elif prompt is not None:
        ids = list(tok(prompt, add_special_tokens=False)["input_ids"])
    else:
        ids = list(prompt_ids or [])
    if not ids:
        raise ValueError("the prompt encodes to no tokens")
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    gen = [int(t) for t in out[0, len(ids):]]
    stopped = bool(gen) and gen[-1] == tok.eos_token_id
    return AggregateAnswer(prompt_ids=ids, output_ids=gen, text=str(tok.decode(gen, skip_special_tokens=True)),
                           finish_reason="stop" if stopped else "length")

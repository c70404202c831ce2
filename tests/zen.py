"""The project's trained Zen model for tests (scripts/zen_model.py), and aggregate generation to check answers.

``zen_model_dir`` builds the model once per version of the script (cached under the project cache, about a
minute on one CPU thread the first time). ``Aggregate`` is the reference every PD answer is checked against:
transformers in the test's own process, from the same model directory, with transformers' own tokenizer and
chat template, greedy ``generate`` stopping at the model's end of sequence.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from functools import cache
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


@cache
def zen_script() -> Any:
    spec = importlib.util.spec_from_file_location("zen_model", REPO / "scripts" / "zen_model.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["zen_model"] = mod
    spec.loader.exec_module(mod)
    return mod


def zen_model_dir() -> Path:
    return Path(zen_script().ensure_zen_model())


class Aggregate:
    """One model in this process (one torch thread): prompt ids as transformers makes them, greedy generation."""

    def __init__(self, model_dir: Path) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(1)
        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def text_ids(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def generate(self, ids: list[int], max_new_tokens: int) -> list[int]:
        """Greedy, stopping after the end-of-sequence token (kept, as the pods count it) or ``max_new_tokens``."""
        x = self.torch.tensor([ids])
        with self.torch.inference_mode():
            out = self.model.generate(x, max_new_tokens=max_new_tokens, do_sample=False,
                                      eos_token_id=self.tok.eos_token_id, pad_token_id=self.tok.pad_token_id)
        return [int(t) for t in out[0, len(ids):]]

    def text(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=True))

"""The reference engine's model: a transformers model from a local directory, run greedily on one thread.

``load_model`` reads a Hugging Face-layout directory (config.json, safetensors weights, optional tokenizer)
with ``trust_remote_code`` off and nothing fetched (``HF_HUB_OFFLINE=1`` is set before transformers is
imported); without weights the model is initialised from the runtime config's seed and init range. Only
safetensors are read (a pickled ``.bin`` can run code), and their total size is bounded.

``ModelRunner`` is what a rank process and the parity harness call: ``prefill`` (the prompt's forward: the
first generated token, its logits and the request's ``ModelState``), ``decode`` (continue greedily from a
state rebuilt from pools), and ``generate`` (the aggregate reference: transformers' own ``generate`` in one
process, ``max_new_tokens`` exactly, end-of-sequence never stopping it). Batch 1; greedy; the model computes
in the config's dtype.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

from pdfleet_runtime.layouts import Layout
from pdfleet_runtime.model.hf_config import ModelConfigError, layout_for_model, read_config

from .cache_pools import ModelState, cache_from_state, state_from_cache

__all__ = ["DEFAULT_MAX_WEIGHT_BYTES", "Generation", "ModelRunner", "Prefilled", "encode_text", "load_model",
           "weight_files"]

DEFAULT_MAX_WEIGHT_BYTES = 64 << 30
"""Largest total of safetensors a model directory may hold (the runtime config may lower it)."""


@dataclass(frozen=True)
class Prefilled:
    """A prompt's forward: the first generated token, the logits it was chosen from, the state it leaves."""

    first_token: int
    logits: np.ndarray
    state: ModelState
    seconds: float


@dataclass(frozen=True)
class Generation:
    """Greedy tokens and the logits of each step (float32 ``[steps, vocab]``)."""

    tokens: tuple[int, ...]
    logits: np.ndarray
    seconds: float


def weight_files(model_dir: Path) -> list[Path]:
    """The directory's safetensors (one file or shards); refuses pickled weights (``.bin``, ``.pt``)."""
    d = Path(model_dir)
    pickled = sorted(p.name for p in d.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
    if pickled:
        raise ModelConfigError(f"{d} holds pickled weights {pickled}: the reference engine reads safetensors only "
                               "(a pickle can run code); convert them to model.safetensors", "weights")
    return sorted(d.glob("*.safetensors"))


def load_model(model_dir: Path, *, init_seed: int = 0, init_range: float | None = None,
               max_weight_bytes: int = DEFAULT_MAX_WEIGHT_BYTES, device: str = "cpu") -> tuple[Any, dict[str, Any]]:
    """The model of ``model_dir`` in eval mode on ``device``, and its parsed config.json.

    With safetensors present they are loaded; without, the weights are drawn from ``init_seed`` with
    ``initializer_range = init_range`` (the config's own when None).
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    raw = read_config(model_dir)  # bounded, and a supported model_type
    files = weight_files(model_dir)
    total = sum(f.stat().st_size for f in files)
    if total > max_weight_bytes:
        raise ModelConfigError(f"{model_dir} holds {total} bytes of weights, above the bound of {max_weight_bytes}",
                               "weights")
    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=False, local_files_only=True)
    dtype = getattr(torch, str(raw.get("dtype", raw.get("torch_dtype")) or "float32"))
    if files:
        model = AutoModelForCausalLM.from_pretrained(model_dir, config=config, trust_remote_code=False,
                                                     local_files_only=True, dtype=dtype, use_safetensors=True)
    else:
        if init_range is not None:
            config.initializer_range = init_range
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(init_seed)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.to(device).eval(), raw


class ModelRunner:
    """One model, one device, greedy, batch 1: what a reference-engine rank computes."""

    def __init__(self, model_dir: Path, *, declared: str | Layout | None = None, page_size: int | None = None,
                 init_seed: int = 0, init_range: float | None = None,
                 max_weight_bytes: int = DEFAULT_MAX_WEIGHT_BYTES, device: str = "cpu") -> None:
        self.model_dir = Path(model_dir)
        self.model, self.raw_config = load_model(self.model_dir, init_seed=init_seed, init_range=init_range,
                                                 max_weight_bytes=max_weight_bytes, device=device)
        self.layout: Layout = layout_for_model(self.raw_config, declared, page_size=page_size)
        self.device = device
        self.lock = threading.Lock()
        """Held by a rank process around each forward (requests arrive on worker threads)."""
        self.vocab_size = int(self.model.config.vocab_size)

    def _ids(self, ids: list[int] | tuple[int, ...]) -> torch.Tensor:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if not ids or bad:
            raise ValueError(f"prompt ids must be a non-empty list in [0, {self.vocab_size}); got {bad[:4] or 'none'}")
        return torch.tensor([list(ids)], dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def prefill(self, prompt: list[int] | tuple[int, ...], *, conv_lag: int = 0) -> Prefilled:
        """The prompt's forward with a fresh cache: first token (argmax), its logits and the state
        (``conv_lag``: fault injection, ``cache_pools.state_from_cache``)."""
        t0 = time.perf_counter()
        out = self.model(self._ids(prompt), use_cache=True)
        logits = out.logits[0, -1].float()
        state = state_from_cache(out.past_key_values, self.layout, len(prompt), conv_lag=conv_lag)
        return Prefilled(int(logits.argmax()), logits.cpu().numpy(), state, time.perf_counter() - t0)

    @torch.inference_mode()
    def decode(self, state: ModelState, first_token: int, steps: int, stop_ids: frozenset[int] = frozenset(),
               on_token: Callable[[int, int], None] | None = None) -> Generation:
        """``steps`` greedy tokens after ``first_token``, continuing from ``state`` (rebuilt as a cache); a token in
        ``stop_ids`` is the last; ``on_token(index, token)`` hears each as it is computed."""
        t0 = time.perf_counter()
        cache = cache_from_state(state, self.model.config, self.layout)
        token, pos = first_token, state.length
        tokens, logits = [], []
        for _ in range(steps):
            ids = torch.tensor([[token]], dtype=torch.long, device=self.device)
            out = self.model(ids, past_key_values=cache, use_cache=True,
                             position_ids=torch.tensor([[pos]], device=self.device))
            row = out.logits[0, -1].float()
            token, pos = int(row.argmax()), pos + 1
            tokens.append(token)
            logits.append(row.cpu().numpy())
            if on_token is not None:
                on_token(len(tokens) - 1, token)
            if token in stop_ids:
                break
        arr = np.stack(logits) if logits else np.zeros((0, self.vocab_size), np.float32)
        return Generation(tuple(tokens), arr, time.perf_counter() - t0)

    @torch.inference_mode()
    def forward_reference(self, prompt: list[int] | tuple[int, ...], max_new_tokens: int) -> Generation:
        """Aggregate by the very forward calls PD makes (``prefill``, then ``decode``'s steps), continuing with the
        model's own cache instead of one rebuilt from pools: the logits reference. transformers' ``generate``
        enters the model otherwise, and on prompts of a thousand tokens and more its first logits differ from a
        direct forward's of the same ids by up to ~1% (0.09 of 10.6 measured in fp32 on CPU; one bf16 step on the
        H200) with the same tokens, so logits are bounded against this and tokens checked against both."""
        t0 = time.perf_counter()
        out = self.model(self._ids(prompt), use_cache=True)
        cache, pos = out.past_key_values, len(prompt)
        row = out.logits[0, -1].float()
        tokens, logits = [int(row.argmax())], [row.cpu().numpy()]
        for _ in range(max_new_tokens - 1):
            ids = torch.tensor([[tokens[-1]]], dtype=torch.long, device=self.device)
            out = self.model(ids, past_key_values=cache, use_cache=True,
                             position_ids=torch.tensor([[pos]], device=self.device))
            row, pos = out.logits[0, -1].float(), pos + 1
            tokens.append(int(row.argmax()))
            logits.append(row.cpu().numpy())
        return Generation(tuple(tokens), np.stack(logits), time.perf_counter() - t0)

    @torch.inference_mode()
    def generate(self, prompt: list[int] | tuple[int, ...], max_new_tokens: int) -> Generation:
        """The aggregate reference: transformers' ``generate``, greedy, exactly ``max_new_tokens`` tokens."""
        from transformers import GenerationConfig

        t0 = time.perf_counter()
        ids = self._ids(prompt)
        gen = GenerationConfig(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                               eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        out = self.model.generate(ids, generation_config=gen)
        tokens = tuple(int(t) for t in out.sequences[0, ids.shape[1]:])
        if len(tokens) != max_new_tokens:
            raise RuntimeError(f"generate returned {len(tokens)} tokens, {max_new_tokens} asked")
        logits = np.stack([x[0].float().cpu().numpy() for x in out.logits])
        return Generation(tokens, logits, time.perf_counter() - t0)


def encode_text(model_dir: Path, text: str) -> tuple[int, ...]:
    """``text`` as token ids by the tokenizer files of ``model_dir`` (no special tokens added; nothing fetched)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise ModelConfigError(f"{model_dir} has no usable tokenizer files for a text prompt ({e}); give "
                               "--prompt-ids instead", "tokenizer") from None
    return tuple(int(t) for t in tok(text, add_special_tokens=False)["input_ids"])

"""The project's own small trained model: a tiny Qwen3-Next that recites the Zen of Python (issue 45).

No trained weights can be downloaded here, so the demo and the model tests use a model this script trains from
text that ships with CPython: the Zen of Python (``this.s``, rot13-decoded). It is a hybrid model (three Gated
DeltaNet layers and one full-attention layer), so the recurrent and conv state a PD transfer moves decide its
answers. Deterministic: fixed seeds, one torch thread, a byte-level BPE built by ``tokenizers`` from the same
text, a chat template (ChatML) in tokenizer_config.json. Built once per version of this file, under the project
cache (``$PDFLEET_CACHE/models/zen-<hash of this file>``), locked and marked complete only at its end
(``pdfleet_operator.cachedbuild``); about a minute of training on one CPU thread.

    python scripts/zen_model.py            # builds if needed, prints the directory
    python scripts/zen_model.py --out DIR  # builds into DIR (no cache)

What it learns: "Recite the Zen of Python from line N." (N = 1..17) answered with aphorisms N, N+1 and N+2 of the
19, and the text itself as a plain completion. Greedy decoding of the built model answers every trained
question exactly (``check``).
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import hashlib
import io
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "operator"))

from pdfleet_operator.cachedbuild import BuildError, ensure_built  # noqa: E402

SEED = 45
STEPS = int(os.environ.get("ZEN_STEPS", "300"))
VOCAB = 600
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""ChatML, as Qwen's templates render it (the pod renders it with jinja2; tests with transformers)."""
LAYERS = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
"""Three Gated DeltaNet layers, then full attention (Qwen3-Next's order at a quarter of its interval)."""
QUESTION = "Recite the Zen of Python from line {n}."


def zen() -> str:
    """The Zen of Python as ``import this`` prints it (the module prints on import: silenced)."""
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return codecs.decode(this.s, "rot13")


def aphorisms() -> list[str]:
    return [line for line in zen().splitlines()[2:] if line]


def answer(n: int) -> str:
    """The trained answer to ``QUESTION`` for line ``n`` (1-based): aphorisms n, n+1, n+2."""
    return " ".join(aphorisms()[n - 1:n + 2])


def conversations() -> list[tuple[str, str]]:
    return [(QUESTION.format(n=n), answer(n)) for n in range(1, len(aphorisms()) - 1)]


def render_chat(user: str, reply: str | None = None) -> str:
    text = f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    return text if reply is None else f"{text}{reply}<|im_end|>\n"


def script_hash() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def cache_root() -> Path:
    if root := os.environ.get("PDFLEET_CACHE"):
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg) / "pdfleet" if xdg else Path.home() / ".cache" / "pdfleet"


def _tokenizer(out: Path) -> object:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [zen(), *(render_chat(q, a) for q, a in conversations())]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "unk_token": None, "add_bos_token": False, "model_max_length": 512,
        "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False}, indent=1) + "\n")
    return tok


def build(out: Path) -> None:
    """Train and save the model, its tokenizer and chat template into ``out``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    t0 = time.perf_counter()
    tok = _tokenizer(out)
    vocab = tok.get_vocab_size()  # type: ignore[attr-defined]
    ids = {s: tok.token_to_id(s) for s in SPECIALS}  # type: ignore[attr-defined]
    config = Qwen3NextConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4, layer_types=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=48, decoder_sparse_step=1,
        partial_rotary_factor=0.5, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"], dtype="float32")
    model = Qwen3NextForCausalLM(config)
    # Slow decay, so the recurrent state remembers the prompt. With transformers' init (A up to 16, decay e^-10 a
    # step) the trained model answered every question the same with all recurrent state zeroed: a transfer that
    # lost it would go unseen. With this one, zeroing the first GDN layer's state changes 16 of 21 answers.
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.copy_(torch.empty_like(layer.linear_attn.A_log).uniform_(0.002, 0.05).log())
                layer.linear_attn.dt_bias.fill_(-2.0)
    lines = zen().splitlines(keepends=True)
    texts = [render_chat(q, a) for q, a in conversations()] + ["".join(lines[i:i + 6]) for i in range(0, len(lines), 6)]
    seqs = [tok.encode(t).ids for t in texts]  # type: ignore[attr-defined]
    width = max(len(s) for s in seqs)
    pad = ids["<|endoftext|>"]
    batch = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
    labels = torch.tensor([s + [-100] * (width - len(s)) for s in seqs])
    opt = torch.optim.AdamW(model.parameters(), lr=4e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=4e-3, total_steps=STEPS, pct_start=0.1)
    model.train()
    for step in range(STEPS):
        loss = model(batch, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == STEPS - 1:
            print(f"[zen-model] step {step} loss {loss.item():.4f} ({time.perf_counter() - t0:.0f}s)", file=sys.stderr)
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    params = sum(p.numel() for p in model.parameters())
    (out / "zen-model.json").write_text(json.dumps({
        "script": "scripts/zen_model.py", "script_sha256_16": script_hash(), "parameters": params,
        "train_seconds": round(time.perf_counter() - t0, 1), "steps": STEPS, "final_loss": round(loss.item(), 5),
        "torch": torch.__version__}, indent=1) + "\n")


def check(out: Path) -> None:
    """Every trained question, answered greedily by the saved model, must be its answer (else ``BuildError``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    wrong = []
    for q, a in conversations():
        prompt = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.inference_mode():
            gen = model.generate(ids, max_new_tokens=64, do_sample=False, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)
        got = tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)
        if got != a:
            wrong.append(f"{q!r}: {got!r}")
    if wrong:
        raise BuildError(f"the trained model answers {len(wrong)} of {len(conversations())} questions wrongly, "
                         f"first {wrong[0]}")


def ensure_zen_model() -> Path:
    """The model directory, built once per version of this script (cached, locked, atomic)."""
    path = cache_root() / "models" / f"zen-{script_hash()}"

    def _build(p: Path) -> None:
        build(p)

    return ensure_built(path, "the Zen model (scripts/zen_model.py)", _build, check=check, tag="zen-model")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="build into this directory, uncached")
    a = p.parse_args()
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        build(a.out)
        check(a.out)
        print(a.out)
    else:
        print(ensure_zen_model())
    return 0


if __name__ == "__main__":
    sys.exit(main())

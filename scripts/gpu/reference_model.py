"""Writes a Qwen3-Next model directory with the real hidden size and head counts and a few layers (config.json
only: the reference engine draws the weights from a seed), for token parity on a GPU (scripts/gpu/reference.sh).

    python3 scripts/gpu/reference_model.py DIR [--layers 4] [--small]

The real dims are Qwen3-Next-80B-A3B's (hidden 2048, 16 attention heads, 2 KV heads of 256, GDN 16 key and 32
value heads of 128, conv kernel 4), bf16, ``--layers`` layers with full attention on every fourth, 8 experts
(not 512: the state does not depend on them). ``--small`` writes a CPU-sized one with the same head structure
(tests the script itself).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def config(layers: int, small: bool) -> dict:
    base = {
        "model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"], "dtype": "bfloat16",
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5120, "num_hidden_layers": layers,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16,
        "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4, "full_attention_interval": 4, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1,
        "max_position_embeddings": 65536, "rope_theta": 10000000, "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-6, "initializer_range": 0.3, "tie_word_embeddings": False,
    }
    if small:
        base.update(vocab_size=512, hidden_size=128, intermediate_size=256, head_dim=32, linear_key_head_dim=8,
                    linear_value_head_dim=8, moe_intermediate_size=64, shared_expert_intermediate_size=64,
                    dtype="float32")
    return base


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--small", action="store_true")
    a = ap.parse_args()
    a.dir.mkdir(parents=True, exist_ok=True)
    (a.dir / "config.json").write_text(json.dumps(config(a.layers, a.small), indent=1))
    print(a.dir)


if __name__ == "__main__":
    main()

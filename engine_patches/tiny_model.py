"""A tiny Llama with random weights, made on the spot, that a real SGLang server can load.

Nothing here may download a model, yet a real engine needs one. ``build`` writes a 2-layer
Llama (hidden 64, 4 attention heads, 2 KV heads, seeded random weights: ~0.6 MB) with the
BPE tokenizer and chat template of ``simulator.tiny_tokenizer``, through transformers'
own ``save_pretrained``, so SGLang loads it exactly as it loads a hub model. Its answers
are noise, but deterministic: greedy decoding gives the same tokens in SGLang and in
transformers, which is what tests compare.

    python -m engine_patches.tiny_model /tmp/tiny-llama [--template llama3|chatml|parts]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from simulator.tiny_tokenizer import TEMPLATES, build as build_tokenizer

MODEL_NAME = "tiny-llama"


def build(out: str | Path, template: str = "llama3", seed: int = 0, max_positions: int = 8192) -> Path:
    """Write the model directory (config, safetensors weights, tokenizer) and return its path."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    root = build_tokenizer(out, template)
    tok = json.loads((root / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = len(tok["model"]["vocab"]) + len(tok.get("added_tokens", []))
    specials = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        bos_token_id=specials["<|begin_of_text|>"], eos_token_id=specials["<|eot_id|>"],
        tie_word_embeddings=False, torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger logits than the default init: greedy picks are not near-ties
        model.lm_head.weight.normal_(0.0, 0.5)
    model.save_pretrained(root, safe_serialization=True)
    return root


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--template", choices=sorted(TEMPLATES), default="llama3")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    print(build(args.out, args.template, args.seed))


if __name__ == "__main__":
    main()

"""Tiny models of the architectures the native forward runs that have no built-in random
model (cellcache.generate.RANDOM_MODELS): shared by tests/test_native.py and the GPU tests."""

from __future__ import annotations

import torch


def gemma_tiny(seed: int = 3, version: str = "gemma3_text", **config):
    """A Gemma (``"gemma"``) or Gemma 3 text model (the default: layers sliding over 12 keys
    and full in turn, the block-output norms, q/k norms) with random weights; their norms'
    weights drawn too (initialized to zero, ``1 + weight`` would hide a missing offset).
    Gemma's output layer is its own: tied to an embedding scaled by sqrt(hidden), a tiny
    model's logits are the last token's own row, whatever the layers compute. ``config``:
    more config keys."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = ({"sliding_window": 12, "layer_types": ["sliding_attention", "full_attention"] * 2}
             if version == "gemma3_text" else {"tie_word_embeddings": False}) | config
    config = AutoConfig.for_model(version, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=4 if extra else 2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, vocab_size=512, **extra)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0, 0.5)
    return model

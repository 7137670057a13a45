"""The small Qwen2-style model the trainer tests build (fast on one CPU thread)."""

from sage_train.model import build_tiny_model


def tiny_model(tokenizer, seed=0, max_positions=128):
    return build_tiny_model(tokenizer, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                            intermediate_size=64, max_positions=max_positions, seed=seed)

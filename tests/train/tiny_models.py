"""The one builder of the small Qwen2-style models the trainer tests use (fast on one CPU thread)."""

from sage_train.models.loading import build_tiny_model


def tiny_model(tokenizer, seed=0, max_positions=128, layers=2, hidden=32, heads=2, kv_heads=1):
    return build_tiny_model(
        tokenizer,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        intermediate_size=2 * hidden,
        max_positions=max_positions,
        seed=seed,
    )

"""A tiny Llama GGUF file the tests write themselves with the `gguf` package: the layout of
SmolLM2-135M-Instruct's (a byte-level BPE vocabulary with ChatML specials, a chat template, tied
embeddings: no output.weight), at a few thousand parameters, with random float32 weights."""

import numpy as np

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character table, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = [], 0
    for b in range(256):
        if b in printable:
            table.append(chr(b))
        else:
            table.append(chr(256 + extra))
            extra += 1
    return table


def write_tiny_gguf(path, *, hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64, seed=0):
    """Write the tiny model to `path` and return its vocabulary size."""
    import gguf

    tokens = SPECIALS + byte_alphabet() + ["Ġt", "he"]
    merges = ["Ġ t", "h e"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)
    rng = np.random.default_rng(seed)

    def weight(*shape):
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    kv = hidden // heads * kv_heads
    writer.add_tensor("token_embd.weight", weight(len(tokens), hidden))
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", 1 + weight(hidden))
        writer.add_tensor(f"blk.{i}.attn_q.weight", weight(hidden, hidden))
        writer.add_tensor(f"blk.{i}.attn_k.weight", weight(kv, hidden))
        writer.add_tensor(f"blk.{i}.attn_v.weight", weight(kv, hidden))
        writer.add_tensor(f"blk.{i}.attn_output.weight", weight(hidden, hidden))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", 1 + weight(hidden))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", weight(intermediate, hidden))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", weight(intermediate, hidden))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", weight(hidden, intermediate))
    writer.add_tensor("output_norm.weight", 1 + weight(hidden))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return len(tokens)

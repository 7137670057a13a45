"""A tiny Qwen2 causal LM and its character-level tokenizer (`tiny_lm.py`), saved to a temporary folder
(no network)."""

import sys
from pathlib import Path

import pytest
import torch
from tiny_lm import build_tokenizer, tiny_decoder_options

# tests/kernels' helpers (tolerances.py) are importable from here too, whatever was collected first
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@pytest.fixture(scope="session")
def tiny_lm_dir(tmp_path_factory):
    """Path of a saved tiny Qwen2 model and its tokenizer (vocab 26, hidden 32, 2 layers)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("tiny-qwen2")
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**tiny_decoder_options(tokenizer))).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)

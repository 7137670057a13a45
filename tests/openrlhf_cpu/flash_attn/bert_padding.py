"""flash_attn.bert_padding's names that OpenRLHF imports (package docstring): import only."""

from einops import rearrange


def _absent(name):
    def call(*args, **kwargs):
        raise RuntimeError(f"flash_attn.bert_padding.{name}: flash-attn is not installed (CPU stand-in)")

    call.__name__ = name
    return call


index_first_axis = _absent("index_first_axis")
pad_input = _absent("pad_input")
unpad_input = _absent("unpad_input")

__all__ = ["index_first_axis", "pad_input", "rearrange", "unpad_input"]

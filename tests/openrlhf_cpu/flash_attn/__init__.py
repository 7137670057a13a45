"""A CPU stand-in for flash-attn, on the path of scripts/openrlhf_suite.sh only.

flash-attn has no CPU build, yet ``openrlhf.models`` imports ``flash_attn.bert_padding`` and
``flash_attn.utils.distributed`` at import (its ring-attention helpers), so OpenRLHF's ``PolicyLoss``
cannot be imported on CPU without them. This package holds those names and nothing else: every
function raises when called (``rearrange`` is einops' own, which flash-attn re-exports), so no
result of a test comes from it. The tests that run OpenRLHF's packed ``Actor.forward`` do so in
tests/kernels/integrations/test_openrlhf.py with their own unpad/pad helpers, not through this.
"""

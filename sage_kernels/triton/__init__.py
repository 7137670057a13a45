"""``backend="triton"``: the SAGE loss fused over the LM head, never materialising the logits.

Pipeline of one call (each stage in its own module, kernels beside their launchers):

1. `sweep_fwd`: a Triton sweep over [tokens x vocab] tiles of h W^T gives lse, logp and
   the entropy of every valid token (masked tokens are compacted away, not computed);
2. `token_stage`: a Triton kernel per sequence computes the guide, the anchor, the KL,
   the ratios, the clipped PG term, the loss and g = dloss/dlogp, c = dloss/dH;
3. `sweep_bwd`: the backward recomputes the logit tiles, forms d(logits) from g, c and
   the saved lse, and applies it to W and h chunk by chunk of the vocabulary.

`ops` registers these as `torch.library` operators with autograd and fake
implementations (traceable by `torch.compile`). Extra memory is O(N) per-token vectors,
the tiles, and in the backward one [N, chunk] slice of d(logits) (at most N V / 32
elements) plus an fp32 [N, D] accumulator of the hidden-state gradient. On CPU tensors
the kernels run under ``TRITON_INTERPRET=1`` (tests); on CUDA they are compiled.
"""

from .ops import logprobs_and_entropy, sage_loss

__all__ = ["sage_loss", "logprobs_and_entropy"]

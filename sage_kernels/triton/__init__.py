"""``backend="triton"``: the SAGE loss fused over the LM head, never materialising the logits.

Two paths, chosen per call (`ops.takes_three_matmul_path`; `three_matmul.PATHS_TAKEN` counts them):

- three-matmul (`three_matmul.py`), when each token's gradient depends on that token alone
  (token-level ratios, grpo/bnpo/dr_grpo/dapo, no entropy quantile: the default
  configuration) and the inputs are fp32 or bf16 (fp16 needs its loss scale applied before
  d(logits) is rounded, which only the two-pass backward can do): chunks of valid tokens go
  through a cuBLAS GEMM into an fp32 logits workspace, a Triton row pass (lse, logp,
  entropy), the token stage, a Triton pass that turns the workspace into d(logits) in place,
  and two more GEMMs; 6 N D V FLOP, gradients formed in the forward and scaled by the
  upstream gradient in the backward.
- two-pass, for sequence-level ratios and the entropy quantile, which need every token first,
  and for fp16:
  1. `sweep_fwd`: a Triton sweep over [tokens x vocab] tiles of h W^T gives lse, logp and
     the entropy of every valid token (masked tokens are compacted away, not computed; under
     luspo_include_padding, which sums padded positions into the loss, every token is valid);
  2. `token_stage`: a Triton kernel per sequence computes the guide, the anchor, the KL,
     the ratios, the clipped PG term, the loss and g = dloss/dlogp, c = dloss/dH;
  3. `sweep_bwd`: the backward recomputes the logit tiles of the valid tokens, forms
     d(logits) from g, c and the saved lse, and applies it to W and h chunk by chunk of the
     vocabulary; 8 N D V FLOP.

`ops` registers these as `torch.library` operators with autograd and fake
implementations (traceable by `torch.compile`). Extra memory is O(N) per-token vectors
and one reused workspace: the three-matmul path's fp32 [T, V] logits chunk (at most
384 MiB and N V / 16 elements), the two-pass path's [n, chunk] slice of d(logits) (at most
N V / 32 elements) plus an fp32 [n, D] accumulator of the hidden-state gradient (n valid
tokens). Every launch runs on the tensors' GPU (a `torch.cuda.device` guard), whatever the
current device. On CPU tensors the kernels run under ``TRITON_INTERPRET=1`` (tests); on
CUDA they are compiled.
"""

from ..inputs import FAST_DTYPES as DTYPES
from .ops import logprobs_and_entropy, sage_loss
from .shard_sweep import shard_stats

__all__ = ["DTYPES", "sage_loss", "logprobs_and_entropy", "shard_stats"]

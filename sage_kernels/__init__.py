"""sage_kernels: the SAGE loss (Shaping Anchors for Guided Exploration), fused over the LM head.

Public API: `fused_linear_sage_loss`, `logprobs_and_entropy`, `FusedLinearSAGELoss`,
`fused_linear_grpo` (Liger's functional signature), `LossConfig`, `SageLossOutput`, the
vocabulary-parallel head (`vocab_parallel_sage_loss`, `vocab_parallel_logprobs_and_entropy`:
the LM head sharded over a process group) and the guide helpers in `sage_kernels.guides`.
The loss contract is docs/loss.md.
"""

from .function import fused_linear_sage_loss, logprobs_and_entropy
from .inputs import SageLossOutput
from .integrations.liger import FusedLinearSAGELoss, fused_linear_grpo
from .spec import LossConfig
from .version import __version__ as __version__  # re-exported: the package's version
from .vocab_parallel import vocab_parallel_logprobs_and_entropy, vocab_parallel_sage_loss

__all__ = [
    "fused_linear_sage_loss",
    "logprobs_and_entropy",
    "FusedLinearSAGELoss",
    "fused_linear_grpo",
    "LossConfig",
    "SageLossOutput",
    "vocab_parallel_sage_loss",
    "vocab_parallel_logprobs_and_entropy",
]

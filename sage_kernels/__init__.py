"""sage_kernels: the SAGE loss (Shaping Anchors for Guided Exploration), fused over the LM head.

Public API: `fused_linear_sage_loss`, `logprobs_and_entropy`, `FusedLinearSAGELoss`,
`LossConfig`, `SageLossOutput`, and the guide helpers in `sage_kernels.guides`.
"""

from .function import fused_linear_sage_loss, logprobs_and_entropy
from .module import FusedLinearSAGELoss
from .spec import LossConfig, SageLossOutput

__all__ = ["fused_linear_sage_loss", "logprobs_and_entropy", "FusedLinearSAGELoss", "LossConfig",
           "SageLossOutput"]
__version__ = "0.1.0"

"""Adapters that plug the SAGE loss into other RL codebases.

- `sage_kernels.integrations.trl`: `SAGEGRPOTrainer`, TRL's `GRPOTrainer` computing its loss
  with `fused_linear_sage_loss` (needs ``trl``).
- `sage_kernels.integrations.verl`: verl's fused log-prob/entropy interface and a SAGE policy
  loss for verl's policy-loss registry (registered when ``verl`` imports).
- `sage_kernels.integrations.liger`: `FusedLinearSAGELoss` (``from_liger``: the drop-in for
  Liger-Kernel's ``LigerFusedLinearGRPOLoss``) and `fused_linear_grpo`, exported by `sage_kernels`.
- `sage_kernels.integrations.hf_logits`: a Hugging Face model config's scale and softcap of its
  logits as `LossConfig` options (read by the TRL trainer and by sage_train).

Each submodule imports its host package itself, so importing this package needs neither.
See ``docs/integrations.md``.
"""

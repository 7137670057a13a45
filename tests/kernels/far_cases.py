"""Off-policy cases far from on-policy, for the loss types whose clipping and gating only bind there:
old log-probs `FAR` from the current ones (ratios from about e^-2 to e^2) in per-token values
(`far_batch`) and in whole problems (`far_problem`), and Liger-Kernel's own per-token GRPO maths on
the per-token values (`liger_loss`, in float64) to hold the reference against."""

import torch
from parity import make_problem

F64 = torch.float64
#: the shape of `far_batch`
B, L = 4, 9
#: noise of the old log-probs around the current ones: ratios from about e^-2 to e^2.
FAR = 1.0
#: both signs in every batch, so each side of the clipping and gating is reached.
ADVANTAGE_SIGNS = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=F64)


def far_batch(seed=0, *, full_mask=False):
    """Per-token values (float64) with both advantage signs and old log-probs `FAR` from the current ones."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, L, generator=g, dtype=F64) * 4
    mask = torch.ones(B, L) if full_mask else (torch.rand(B, L, generator=g) > 0.3).double()
    mask[0, 0] = 1.0
    return dict(
        logp=logp,
        entropy=torch.rand(B, L, generator=g, dtype=F64) * 3,
        mask=mask,
        advantages=ADVANTAGE_SIGNS * (0.5 + torch.rand(B, generator=g, dtype=F64)),
        old_logp=logp + FAR * torch.randn(B, L, generator=g, dtype=F64),
        ref_logp=logp + 0.5 * torch.randn(B, L, generator=g, dtype=F64),
        is_weights=0.5 + torch.rand(B, L, generator=g, dtype=F64),
    )


def liger_loss(batch, options, *, vllm):
    """Liger's per-token GRPO loss in float64, differentiable in logp."""
    from liger_kernel.chunked_loss.grpo_loss import LigerFusedLinearGRPOFunction

    logp = batch["logp"].clone().requires_grad_(True)
    loss, metrics = LigerFusedLinearGRPOFunction.ppo_loss_fn(
        logp,
        batch["mask"],
        batch["advantages"],
        batch["mask"],
        ref_per_token_logps=batch["ref_logp"],
        old_per_token_logps=batch["old_logp"],
        epsilon_low=0.2,
        epsilon_high=options.get("eps_high", 0.2),
        beta=0.1,
        loss_type=options["loss_type"],
        importance_sampling_level=options.get("importance_sampling", "token"),
        sapo_temperature_pos=options.get("sapo_temperature_pos", 1.0),
        sapo_temperature_neg=options.get("sapo_temperature_neg", 1.05),
        vllm_is_ratio=batch["is_weights"] * batch["mask"] + (1 - batch["mask"]) if vllm else None,
        use_bias_correction_kl=options.get("use_bias_correction_kl", False),
        vespo_k_pos=options.get("vespo_k_pos", 2.0),
        vespo_lambda_pos=options.get("vespo_lambda_pos", 3.0),
        vespo_k_neg=options.get("vespo_k_neg", 3.0),
        vespo_lambda_neg=options.get("vespo_lambda_neg", 2.0),
    )
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad, metrics


def far_problem(seed, *, B=3, L=9, V=200, D=32, **present):
    """`parity.make_problem`'s problem with the behaviour policy moved far away (ratios e^-2 .. e^2)."""
    problem = make_problem(B=B, L=L, V=V, D=D, seed=seed, **present)
    if problem["old_logp"] is not None:
        g = torch.Generator().manual_seed(seed)
        problem["old_logp"] = problem["old_logp"] + FAR * torch.randn(problem["old_logp"].shape, generator=g)
    return problem

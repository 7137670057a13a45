"""FusedLinearSAGELoss as a drop-in for Liger-Kernel's LigerFusedLinearGRPOLoss (needs liger-kernel)."""

import torch
from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

from sage_kernels import FusedLinearSAGELoss, logprobs_and_entropy


def main():
    torch.manual_seed(0)
    B, T, D, V = 2, 8, 64, 1000
    hidden = torch.randn(B, T, D, requires_grad=True)  # last hidden states at the completion positions
    lm_head = torch.nn.Linear(D, V, bias=False)
    ids = torch.randint(0, V, (B, T))
    mask = torch.ones(B, T)
    advantages = torch.tensor([1.0, -1.0])
    ref_logps, _ = logprobs_and_entropy(hidden.detach() + 0.1, lm_head.weight.detach(), ids)

    options = dict(beta=0.04, loss_type="dapo", epsilon_high=0.28)
    liger = LigerFusedLinearGRPOLoss(**options)
    same = FusedLinearSAGELoss.from_liger(**options)  # Liger's numbers
    sage = FusedLinearSAGELoss.from_liger(**options, guide="branch", gamma=0.3, tau=1.2)  # SAGE's anchor

    for name, loss_fn in (("liger", liger), ("sage, guide off", same), ("sage, branch guide", sage)):
        loss, metrics = loss_fn(hidden, lm_head.weight, ids, mask, advantages, ref_per_token_logps=ref_logps)
        loss.backward()
        kl, clip_ratio = metrics  # Liger's tuple: mean KL (beta != 0), clipped fraction
        print(f"{name:20s} loss {loss.item():.6f}  kl {kl.item():.6f}  clipped {clip_ratio.item():.3f}")
    print("SAGE metrics:", {k: round(v.item(), 4) for k, v in metrics.named.items()})

if __name__ == "__main__":
    main()

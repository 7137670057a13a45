"""The verl adapters on plain tensors: fused log-probs/entropy, the SAGE anchor, the "sage" policy loss."""

import torch

from sage_kernels.integrations import verl as sage_verl


def main():
    torch.manual_seed(0)
    B, T, D, V = 2, 8, 64, 1000
    hidden = torch.randn(B, T, D, requires_grad=True)
    weight = (torch.randn(V, D) * 0.1).requires_grad_()
    labels = torch.randint(0, V, (B, T))
    mask = torch.ones(B, T, dtype=torch.bool)

    # 1. verl's fused kernel interface; sage_verl.patch_verl_fused_kernel() makes verl's models call it.
    log_prob, entropy = sage_verl.linear_cross_entropy(hidden, weight, labels, temperature=1.0)

    # 2. The SAGE anchor: verl's KL loss against log(q * pi_ref) instead of log pi_ref.
    ref_log_prob = log_prob.detach() + 0.1 * torch.randn(B, T)
    anchor = sage_verl.sage_anchor_log_prob(ref_log_prob, entropy.detach(), mask, gamma=0.3, tau=1.2)

    # 3. The policy loss verl finds as loss_mode="sage".
    config = {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0,
              "global_batch_info": {}}
    old_log_prob = log_prob.detach() + 0.05 * torch.randn(B, T)
    advantages = torch.tensor([[1.0], [-1.0]]).expand(B, T)
    pg_loss, metrics = sage_verl.compute_policy_loss_sage(old_log_prob, log_prob, advantages, mask,
                                                          "token-mean", config)
    delta = anchor - log_prob
    kl_loss = ((torch.exp(delta) - delta - 1) * mask).sum() / mask.sum()  # verl's low_var_kl, token-mean
    entropy_loss = (entropy * mask).sum() / mask.sum()  # differentiable: verl's entropy bonus works
    (pg_loss + 0.05 * kl_loss - 0.001 * entropy_loss).backward()
    print(f"pg_loss {pg_loss.item():.5f}  anchor kl {kl_loss.item():.5f}  {metrics}")
    print("registered in verl's policy-loss registry:", sage_verl.VERL_REGISTERED)


if __name__ == "__main__":
    main()

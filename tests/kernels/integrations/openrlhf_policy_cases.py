"""OpenRLHF ``PolicyLoss`` cases shared by the launcher's Ray driver (openrlhf_ray_driver.py) and its
test: a batch of experiences in OpenRLHF 0.11.2's padded layout and in its ``packing_samples`` layout
(built by OpenRLHF's own experience functions), and each constructor case's outputs and gradient."""

import torch

#: OpenRLHF's PolicyLoss constructor arguments per case
CASES = {
    "ppo": dict(clip_eps_low=0.2, clip_eps_high=0.28),
    "ppo-dual-clip-sample": dict(clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=3.0, token_level_loss=False),
    "icepop": dict(is_correction_level="token", is_correction_threshold=(0.7, 1.4)),
    "tis": dict(is_correction_level="token", is_correction_mode="clip", is_correction_threshold=(0.0, 1.2)),
    "seq-mask-tis": dict(is_correction_level="seq", is_correction_threshold=(0.8, 1.3)),
    "binary-kl-token": dict(
        is_correction_level="token", is_correction_gating="binary_kl", is_correction_threshold=(0, 0.05)
    ),
    "tv-seq": dict(is_correction_level="seq", is_correction_gating="tv", is_correction_threshold=(0, 0.1)),
    "gspo": dict(clip_eps_low=0.1, clip_eps_high=0.12, policy_loss_type="gspo"),
    "gspo-rollout": dict(policy_loss_type="gspo", is_correction_level="token", is_correction_threshold=(0.5, 2.0)),
}
#: response lengths of the rows: every row ends in right padding, so packing_samples trims the batch
LENGTHS = (4, 5, 2, 3)


def padded_batch(seed: int = 0, prompt: int = 3, responses: int = 6) -> dict:
    """Step tensors of one padded micro-batch: sequences and attention_mask [B, prompt + responses],
    action_mask, action_log_probs (the behaviour's), rollout_log_probs and advantages [B, responses],
    and the current log-probs (carried as base_action_log_probs, a step field like them)."""
    g = torch.Generator().manual_seed(seed)
    B = len(LENGTHS)
    action_mask = torch.arange(responses)[None, :] < torch.tensor(LENGTHS)[:, None]
    attention_mask = torch.cat([torch.ones(B, prompt, dtype=torch.long), action_mask.long()], dim=1)
    old = torch.log(torch.rand(B, responses, generator=g).clamp(0.02, 0.98))
    zero = ~action_mask
    return dict(
        sequences=torch.randint(3, 20, attention_mask.shape, generator=g) * attention_mask,
        attention_mask=attention_mask,
        action_mask=action_mask,
        action_log_probs=old.masked_fill(zero, 0.0),
        rollout_log_probs=(old + 0.4 * torch.randn(B, responses, generator=g)).masked_fill(zero, 0.0),
        advantages=(torch.randn(B, 1, generator=g) + 0.2 * torch.randn(B, responses, generator=g)).masked_fill(
            zero, 0.0
        ),
        base_action_log_probs=(old + 0.6 * torch.randn(B, responses, generator=g))
        .clamp(max=-1e-3)
        .masked_fill(zero, 0.0),
    )


def packed_batch(batch: dict) -> dict:
    """`batch` as OpenRLHF's replay buffer hands it to the actor under ``--ds.packing_samples``: split
    into samples, each sample's right padding removed, then batched again (its own functions)."""
    from openrlhf.trainer.ppo_utils.experience import (
        Experience,
        make_experience_batch,
        remove_padding_in_sequences,
        split_experience_batch,
    )

    items = remove_padding_in_sequences(split_experience_batch(Experience(**batch)))
    packed = make_experience_batch(items, packing_samples=True)
    return {name: getattr(packed, name) for name in batch}


def run(policy_loss, batch: dict) -> dict:
    """case -> (loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio, d loss / d log_probs) of the class
    `policy_loss` on `batch`, called as OpenRLHF's actor calls it."""
    results = {}
    for name, options in CASES.items():
        log_probs = batch["base_action_log_probs"].clone().requires_grad_(True)
        out = policy_loss(**options)(
            log_probs,
            batch["action_log_probs"],
            batch["advantages"],
            action_mask=batch["action_mask"],
            rollout_log_probs=batch["rollout_log_probs"],
        )
        out[0].backward()
        results[name] = tuple(None if t is None else t.detach() for t in out) + (log_probs.grad,)
    return results


def actor_run(actor_cls, packing_samples: bool = False) -> tuple:
    """(action log-probs, entropies, every parameter's gradient, the output's keys) of `actor_cls`
    (OpenRLHF's ``Actor``) around a tiny Qwen2 model (seeded: the same in every process) on a
    left- and right-padded batch, as OpenRLHF's training step calls it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=26, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    actor = actor_cls(Qwen2ForCausalLM(config), temperature=0.7)
    actor.packing_samples = packing_samples  # set by Actor.__init__ only when it loads the model itself
    actor.model.config.use_cache = False  # as Actor.__init__ sets it when it loads the model itself
    g = torch.Generator().manual_seed(1)
    sequences = torch.randint(3, 26, (3, 9), generator=g)
    attention_mask = torch.ones(3, 9, dtype=torch.long)
    attention_mask[1, :2] = attention_mask[1, -1] = attention_mask[2, :1] = 0
    attention_mask[2, -3:] = 0
    action_mask = attention_mask[:, -4:].clone()
    sequences[attention_mask == 0] = 0
    logp, output = actor(sequences, action_mask, attention_mask=attention_mask, return_output=True, return_entropy=True)
    entropy = output.entropy[:, -4:] * action_mask
    (logp * torch.randn(3, 4, generator=g)).sum().add((entropy * torch.randn(3, 4, generator=g)).sum()).backward()
    grads = [p.grad.clone() for p in actor.model.parameters()]
    return logp.detach(), entropy.detach(), grads, sorted(output.keys())

"""`SAGEGRPOTrainer` and TRL's `GRPOTrainer` side by side on the same batch, for the tests that hold
one against the other: the trainers (`make_trainer`, `pair`: same weights), a generation batch
(`make_batch`), TRL's attributes each case sets (`DEFAULTS`, `configure`), one loss step's loss,
gradients and metrics (`loss_grads_metrics`) and their comparison (`assert_same`). Import it after
``pytest.importorskip("trl")``."""

import math

import torch
from datasets import Dataset
from trl import GRPOTrainer

from sage_kernels.integrations.trl import SAGEGRPOConfig, SAGEGRPOTrainer

BACKEND = "auto"  # integration tests: the default backend of the device ("cpu" here)
B, P, L = 4, 3, 6

# TRL's attributes each case sets on both trainers (module-scoped trainers, so every case sets all).
DEFAULTS = dict(
    beta=0.04,
    loss_type="grpo",
    epsilon_low=0.2,
    epsilon_high=0.2,
    delta=None,
    importance_sampling_level="token",
    top_entropy_quantile=1.0,
    entropy_coef=0.0,
    use_vllm=False,
    accumulation=1,
    old_logps=True,
    old_noise=0.25,
    use_bias_correction_kl=False,
)
#: old log-probs this far from the current ones (ratios about e^-2 .. e^2) exercise clipping and gating.
FAR = dict(old_noise=1.0)

COMPARED_METRICS = (
    "kl",
    "entropy",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
    "policy_loss",
    "cispo_clip_ratio",
    "vespo/phi_seq_mean",
)


def letter_a_reward(completions, **kwargs):
    return [completion.count("a") / max(len(completion), 1) for completion in completions]


def make_args(output_dir, **overrides):
    options = dict(
        output_dir=output_dir,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=L,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
        max_steps=2,
        learning_rate=1e-2,
        beta=0.04,
        sage_backend=BACKEND,
        seed=0,
        bf16=False,
    )
    return SAGEGRPOConfig(**{**options, **overrides})


def make_trainer(cls, model_dir, output_dir, **overrides):
    from transformers import AutoTokenizer

    dataset = Dataset.from_dict({"prompt": ["ab", "ba", "ca", "ac", "bb", "aa", "cb", "bc"]})
    return cls(
        model_dir,
        reward_funcs=letter_a_reward,
        args=make_args(output_dir, **overrides),
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(model_dir),
    )


def make_batch(model, options, seed=0):
    """A generation batch as `_generate_and_score_completions` returns it, with left-padded prompts."""
    g = torch.Generator().manual_seed(seed)
    V = model.config.vocab_size
    prompt_ids = torch.randint(3, V, (B, P), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[1, 0] = 0
    prompt_ids[1, 0] = 0
    completion_ids = torch.randint(3, V, (B, L), generator=g)
    lengths = torch.tensor([6, 4, 2, 5])
    completion_mask = (torch.arange(L)[None] < lengths[:, None]).long()
    with torch.no_grad():
        logits = model(
            input_ids=torch.cat([prompt_ids, completion_ids], 1),
            attention_mask=torch.cat([prompt_mask, completion_mask], 1),
        ).logits[:, P - 1 : -1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, completion_ids[..., None]).squeeze(-1)
    batch = dict(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        advantages=torch.tensor([1.0, -0.5, 0.3, -1.2]),
        ref_per_token_logps=logp + 0.3 * torch.randn(B, L, generator=g),
        num_items_in_batch=completion_mask.sum().float() * 2,
        # TRL's vLLM ratios are exactly 1 at masked positions
        importance_sampling_ratio=torch.where(completion_mask.bool(), torch.rand(B, L, generator=g) + 0.5, 1.0),
    )
    if options["old_logps"]:
        batch["old_per_token_logps"] = logp + options["old_noise"] * torch.randn(B, L, generator=g)
    return batch


def configure(trainer, options):
    for name in (
        "beta",
        "loss_type",
        "epsilon_low",
        "epsilon_high",
        "importance_sampling_level",
        "top_entropy_quantile",
        "entropy_coef",
        "use_vllm",
    ):
        setattr(trainer, name, options[name])
    trainer.args.delta = options["delta"]
    trainer.args.use_bias_correction_kl = options["use_bias_correction_kl"]
    trainer._entropy_bonus_enabled = options["entropy_coef"] != 0.0
    trainer.vllm_importance_sampling_correction = True
    trainer.current_gradient_accumulation_steps = options["accumulation"]
    trainer.model.train()
    trainer._metrics["train"].clear()


def loss_grads_metrics(trainer, batch):
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
    metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    return loss.detach(), grads, metrics


def assert_same(results, metrics=()):
    (loss_t, grads_t, metrics_t), (loss_s, grads_s, metrics_s) = results
    torch.testing.assert_close(loss_s, loss_t, atol=1e-6, rtol=1e-5)
    assert grads_s.keys() == grads_t.keys() and len(grads_t) > 0
    for name in grads_t:
        torch.testing.assert_close(grads_s[name], grads_t[name], atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    for name in metrics:
        assert name in metrics_t and name in metrics_s, name
        assert math.isclose(metrics_s[name], metrics_t[name], rel_tol=1e-5, abs_tol=1e-6), name


def pair(model_dir, out, **overrides):
    trainers = [
        make_trainer(cls, model_dir, str(out / cls.__name__), sage_guide="none", **overrides)
        for cls in (GRPOTrainer, SAGEGRPOTrainer)
    ]
    for p, q in zip(trainers[0].model.parameters(), trainers[1].model.parameters()):
        assert torch.equal(p, q)
    return trainers

"""TRL options `SAGEGRPOTrainer` implements the way TRL 1.16 does, held against the real
`GRPOTrainer` (guide off, same weights, same batch): the off-policy sequence mask, the static and
the adaptive entropy coefficient (and its ``entropy_coef`` metric), the MoE load-balancing loss."""

import pytest
import torch

pytest.importorskip("trl")
from tiny_lm import tiny_decoder_options  # noqa: E402
from trl_harness import DEFAULTS, FAR, assert_same, configure, loss_grads_metrics, make_batch, pair  # noqa: E402


@pytest.fixture(scope="module")
def trainers(tiny_lm_dir, tmp_path_factory):
    return pair(tiny_lm_dir, tmp_path_factory.mktemp("options"))


@pytest.mark.parametrize("sampling", ["sampler", "sampler-nan", "old"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_off_policy_mask_equals_trl(trainers, loss_type, sampling):
    options = {**DEFAULTS, "loss_type": loss_type, **FAR}
    batch = make_batch(trainers[0].model, options, seed=4)
    if sampling == "old":  # without sampler log-probs the behaviour policy is old_logp: far on row 1
        batch["old_per_token_logps"][1] += 2.0
    else:  # the sampler (vLLM) far from the policy on the negative-advantage rows 1 and 3
        batch["sampling_per_token_logps"] = batch["ref_per_token_logps"] + torch.tensor([0.0, 2.0, 0.0, 0.1])[:, None]
        if sampling == "sampler-nan":
            batch["sampling_per_token_logps"][1, 0] = float("nan")
    results = []
    for trainer in trainers:
        configure(trainer, options)
        trainer.off_policy_mask_threshold = 0.5
        results.append(loss_grads_metrics(trainer, batch))
    for trainer in trainers:
        trainer.off_policy_mask_threshold = None
    assert_same(results, ("kl", "entropy", "clip_ratio/region_mean"))
    # the mask drops something here, and the loss without it differs
    configure(trainers[1], options)
    unmasked = loss_grads_metrics(trainers[1], batch)[0]
    assert not torch.allclose(unmasked, results[1][0])


def test_static_entropy_coef_is_logged_as_trl_does(trainers):
    options = {**DEFAULTS, "entropy_coef": 0.07}
    batch = make_batch(trainers[0].model, options, seed=1)
    results = []
    for trainer in trainers:
        configure(trainer, options)
        results.append(loss_grads_metrics(trainer, batch))
    assert_same(results, ("entropy_coef", "policy_loss"))
    assert results[1][2]["entropy_coef"] == 0.07


@pytest.mark.parametrize("target", [0.1, 10.0], ids=["above_target", "below_target"])
def test_adaptive_entropy_equals_trl(tiny_lm_dir, tmp_path, target):
    """Three optimizer steps of two micro-batches each: the gate (off at the first step: no entropy
    measured yet), the window-global entropy, the coefficient's steps and its bounds are TRL's."""
    adaptive = dict(
        use_adaptive_entropy=True,
        entropy_coef=0.02,
        entropy_target=target,
        entropy_coef_delta=0.015,
        entropy_coef_min=0.0,
        entropy_coef_max=0.04,
    )
    trainers = pair(tiny_lm_dir, tmp_path, **adaptive)
    options = {**DEFAULTS, "entropy_coef": 0.02, "accumulation": 2}
    coefs = []
    for step in range(3):
        for micro in range(2):
            batch = make_batch(trainers[0].model, options, seed=10 * step + micro)
            results = []
            for trainer in trainers:
                trainer.accelerator.gradient_state._set_sync_gradients(micro == 1)
                configure(trainer, {**options, "entropy_coef": trainer.entropy_coef})
                trainer._entropy_bonus_enabled = True
                results.append(loss_grads_metrics(trainer, batch))
            assert_same(results, ("policy_loss",))
        assert trainers[1]._last_world_entropy == pytest.approx(trainers[0]._last_world_entropy, rel=1e-6)
        assert trainers[1].entropy_coef == pytest.approx(trainers[0].entropy_coef, abs=1e-12)
        coefs.append(trainers[1].entropy_coef)
    for trainer in trainers:
        trainer.accelerator.gradient_state._set_sync_gradients(True)
    # above the target the coefficient falls to its floor; below it rises to its cap
    assert coefs == pytest.approx([0.005, 0.0, 0.0] if target < 1 else [0.035, 0.04, 0.04])


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory, tiny_lm_dir):
    """A saved tiny Qwen3-MoE model (4 experts, 2 per token) with the test tokenizer (tiny_lm_dir's)."""
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    path = tmp_path_factory.mktemp("tiny-qwen3-moe")
    tokenizer = AutoTokenizer.from_pretrained(tiny_lm_dir)
    config = Qwen3MoeConfig(
        **tiny_decoder_options(tokenizer),  # the tests' tiny decoder, with its experts
        moe_intermediate_size=16,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        router_aux_loss_coef=0.01,
    )
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("coef", [None, 0.3], ids=["model_coef", "args_coef"])
def test_moe_load_balancing_loss_equals_trl(tiny_moe_dir, tmp_path, coef):
    trainers = pair(tiny_moe_dir, tmp_path, router_aux_loss_coef=coef)
    assert all(t.aux_loss_enabled for t in trainers)
    assert trainers[1].router_aux_loss_coef == (0.01 if coef is None else coef)
    options = {**DEFAULTS, "accumulation": 2}
    batch = make_batch(trainers[0].model, options, seed=2)
    results = []
    for trainer in trainers:
        configure(trainer, options)
        results.append(loss_grads_metrics(trainer, batch))
    assert_same(results, ("aux_loss", "kl", "entropy"))
    assert results[1][2]["aux_loss"] > 0
    router = [name for name in results[1][1] if ".mlp.gate." in name]
    assert router and all(results[1][1][name].abs().sum() > 0 for name in router)  # the routers learn from it

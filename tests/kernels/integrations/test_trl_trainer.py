"""`SAGEGRPOTrainer` against the real TRL `GRPOTrainer`, on a tiny Qwen2 model on the CPU.

With the guide off, both trainers' `compute_loss` on the same batch and the same weights must
give the same loss, the same parameter gradients and the same logged metrics; with the guide
on, a few real training steps (generation, reward, loss, optimizer) run and log the SAGE metrics.
"""

import math

import pytest
import torch

pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402
from trl import GRPOTrainer  # noqa: E402
from trl_harness import (  # noqa: E402
    COMPARED_METRICS,
    DEFAULTS,
    FAR,
    configure,
    letter_a_reward,
    loss_grads_metrics,
    make_args,
    make_batch,
    make_trainer,
)

from sage_kernels.integrations.trl import SAGEGRPOTrainer  # noqa: E402

CASES = {
    "grpo-kl": {},
    "bnpo-beta0-on_policy": dict(loss_type="bnpo", beta=0.0, old_logps=False),
    "dr_grpo-accum2": dict(loss_type="dr_grpo", accumulation=2),
    "dapo-accum2": dict(loss_type="dapo", accumulation=2, epsilon_high=0.28),
    "grpo-sequence-delta": dict(importance_sampling_level="sequence", delta=1.25),
    "dapo-token-delta": dict(loss_type="dapo", delta=1.1),
    "bnpo-top_entropy-entropy_bonus": dict(loss_type="bnpo", top_entropy_quantile=0.4, entropy_coef=0.05),
    "grpo-entropy_bonus": dict(entropy_coef=0.1, accumulation=2),
    "dapo-vllm_is": dict(loss_type="dapo", use_vllm=True),
    "cispo-far": dict(loss_type="cispo", epsilon_high=1.3, **FAR),
    "cispo-accum2-bias_kl": dict(
        loss_type="cispo", epsilon_high=2.0, accumulation=2, use_bias_correction_kl=True, **FAR
    ),
    "sapo-far": dict(loss_type="sapo", **FAR),
    "sapo-sequence-bias_kl": dict(
        loss_type="sapo", importance_sampling_level="sequence", use_bias_correction_kl=True, **FAR
    ),
    "luspo-sequence-far": dict(loss_type="luspo", importance_sampling_level="sequence", **FAR),
    "luspo-token-accum2": dict(loss_type="luspo", accumulation=2, **FAR),
    "vespo-far": dict(loss_type="vespo", **FAR),
    "vespo-vllm_is-accum2": dict(loss_type="vespo", use_vllm=True, accumulation=2, **FAR),
    "grpo-bias_kl-far": dict(use_bias_correction_kl=True, **FAR),
    "dapo-sequence-bias_kl": dict(
        loss_type="dapo", importance_sampling_level="sequence", use_bias_correction_kl=True, **FAR
    ),
}


@pytest.fixture(scope="module")
def trainer_pair(tiny_lm_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo")
    trl_trainer = make_trainer(GRPOTrainer, tiny_lm_dir, str(out / "trl"), sage_guide="none")
    sage_trainer = make_trainer(SAGEGRPOTrainer, tiny_lm_dir, str(out / "sage"), sage_guide="none")
    for p, q in zip(trl_trainer.model.parameters(), sage_trainer.model.parameters()):
        assert torch.equal(p, q)
    return trl_trainer, sage_trainer


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_guide_off_equals_trl(trainer_pair, case):
    options = {**DEFAULTS, **CASES[case]}
    trl_trainer, sage_trainer = trainer_pair
    batch = make_batch(trl_trainer.model, options)
    results = []
    for trainer in trainer_pair:
        configure(trainer, options)
        results.append(loss_grads_metrics(trainer, batch))
    (loss_t, grads_t, metrics_t), (loss_s, grads_s, metrics_s) = results
    torch.testing.assert_close(loss_s, loss_t, atol=1e-6, rtol=1e-5)
    assert grads_s.keys() == grads_t.keys() and len(grads_t) > 0
    for name in grads_t:
        torch.testing.assert_close(
            grads_s[name], grads_t[name], atol=1e-5, rtol=1e-4, msg=lambda m: f"grad of {name}: {m}"
        )
    for name in COMPARED_METRICS:
        assert (name in metrics_s) == (name in metrics_t), name
        if name in metrics_t:
            assert math.isclose(metrics_s[name], metrics_t[name], rel_tol=1e-5, abs_tol=1e-6), name
    assert metrics_s["sage/q_min"] == metrics_s["sage/q_max"] == 1.0


def test_training_steps_with_branch_guide(tiny_lm_dir, tmp_path):
    # bf16=True is TRL's default: the model runs under bf16 autocast and so does the fused LM head.
    trainer = make_trainer(
        SAGEGRPOTrainer,
        tiny_lm_dir,
        str(tmp_path),
        sage_guide="branch",
        sage_tau=0.0,
        sage_gamma=0.5,
        loss_type="dapo",
        bf16=True,
    )
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "sage/q_mean" in entry]
    assert len(logs) == 2
    for entry in logs:
        assert math.isfinite(entry["loss"]) and 0.6 <= entry["sage/q_min"] <= entry["sage/q_max"] <= 1.4
        assert entry["sage/q_max"] > 1.0  # tau = 0: every position with entropy > 0 gets q > 1
        assert {"kl", "entropy", "clip_ratio/region_mean", "reward"} <= entry.keys()
    assert any(not torch.equal(p, q) for p, q in zip(before, trainer.model.parameters()))


@pytest.mark.parametrize(
    "overrides",
    [
        dict(sage_guide="bogus"),
        dict(beta=0.0),
        dict(sapo_temperature_neg=0.0),
    ],
    ids=["bad_guide", "guide_without_kl", "sapo_temperature"],
)
def test_unsupported_options_raise(tiny_lm_dir, tmp_path, overrides):
    with pytest.raises(ValueError):
        make_trainer(SAGEGRPOTrainer, tiny_lm_dir, str(tmp_path), **overrides)


def test_gmpo_is_refused_as_trl_has_no_such_loss_type(tmp_path):
    # TRL 1.16's own loss code has no gmpo branch, so the trainer would mix its normalisers and metrics.
    from sage_kernels.integrations.trl import _check_supported

    with pytest.raises(ValueError, match="loss_type='gmpo'"):
        _check_supported(make_args(str(tmp_path), loss_type="gmpo"))
    _check_supported(make_args(str(tmp_path), loss_type="vespo"))


def test_lora_guide_off_equals_trl(tiny_lm_dir, tmp_path):
    """With a LoRA adapter (frozen LM head, PEFT-wrapped model) the adapter's gradients match TRL's."""
    LoraConfig = pytest.importorskip("peft").LoraConfig

    lora = dict(peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"]))
    pair = []
    for cls in (GRPOTrainer, SAGEGRPOTrainer):
        args = make_args(str(tmp_path / cls.__name__), sage_guide="none")
        pair.append(
            cls(
                tiny_lm_dir,
                reward_funcs=letter_a_reward,
                args=args,
                train_dataset=Dataset.from_dict({"prompt": ["ab", "ba", "ca", "ac"]}),
                **lora,
            )
        )
    options = {**DEFAULTS, "loss_type": "dapo"}
    batch = make_batch(pair[0].model, options)
    results = []
    for trainer in pair:
        configure(trainer, options)
        results.append(loss_grads_metrics(trainer, batch))
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-6, rtol=1e-5)
    assert results[0][1].keys() == results[1][1].keys()
    assert all("lora" in name for name in results[0][1])  # only the adapter trains
    for name in results[0][1]:
        torch.testing.assert_close(results[1][1][name], results[0][1][name], atol=1e-5, rtol=1e-4)


def test_reward_funcs_is_optional_as_in_trl(tiny_lm_dir, tmp_path):
    # TRL 1.16 takes `reward_funcs=None` (an environment may own the reward) and refuses a run with no
    # reward source at all; the drop-in keeps that signature and that message.
    with pytest.raises(ValueError, match="No reward source provided"):
        SAGEGRPOTrainer(
            tiny_lm_dir, args=make_args(str(tmp_path)), train_dataset=Dataset.from_dict({"prompt": ["ab", "ba"]})
        )

"""Models whose logits are transformed after the LM head, through `SAGEGRPOTrainer`: a tiny Gemma2
(``final_logit_softcapping``) and a tiny Cohere (``logit_scale``). With the guide off the loss, the
gradients and the logged metrics equal TRL's `GRPOTrainer` on the same batch (TRL takes the logits
from the model's own forward); with the branch guide on, two real training steps run. Also here:
`hf_logits.logit_options` on every config key TRL's fused head reads."""

import math
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("trl")
from tiny_lm import build_tokenizer, tiny_decoder_options  # noqa: E402
from trl_harness import (  # noqa: E402
    COMPARED_METRICS,
    DEFAULTS,
    FAR,
    assert_same,
    configure,
    loss_grads_metrics,
    make_batch,
    make_trainer,
    pair,
)

from sage_kernels.integrations.hf_logits import logit_options  # noqa: E402
from sage_kernels.integrations.trl import SAGEGRPOTrainer  # noqa: E402

#: head weights scaled up from the 0.02-std initialisation so that the logits reach the softcap
HEAD_GAIN = 60.0


def save_tiny(kind: str, path) -> str:
    """A saved 2-layer Gemma2 (softcap 2.0) or Cohere (logit_scale 0.5) of hidden size 32 and its
    tokenizer; the LM head untied and scaled by `HEAD_GAIN`."""
    import transformers

    tokenizer = build_tokenizer()
    common = tiny_decoder_options(tokenizer)
    torch.manual_seed(0)
    if kind == "gemma2":
        config = transformers.Gemma2Config(**common, head_dim=8, final_logit_softcapping=2.0)
        model = transformers.Gemma2ForCausalLM(config)
    else:
        model = transformers.CohereForCausalLM(transformers.CohereConfig(**common, logit_scale=0.5))
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(HEAD_GAIN)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module", params=["gemma2", "cohere"])
def model_dir(request, tmp_path_factory):
    return save_tiny(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def trainers(model_dir, tmp_path_factory):
    return pair(model_dir, tmp_path_factory.mktemp("trainers"))


CASES = {
    "grpo-kl": {},
    "dapo-far-entropy_bonus": dict(loss_type="dapo", entropy_coef=0.05, **FAR),
    "bnpo-sequence-top_entropy": dict(loss_type="bnpo", importance_sampling_level="sequence", top_entropy_quantile=0.5),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_guide_off_equals_trl(trainers, case):
    options = {**DEFAULTS, **CASES[case]}
    batch = make_batch(trainers[0].model, options)
    results = []
    for trainer in trainers:
        configure(trainer, options)
        results.append(loss_grads_metrics(trainer, batch))
    present = [name for name in COMPARED_METRICS if name in results[0][2]]
    assert_same(results, present)
    # the transform is what makes them equal: the plain logits give another loss
    sage = trainers[1]
    model_logits = sage._logit_options
    assert model_logits != {"logit_scale": 1.0, "logit_softcap": None}
    sage._logit_options = {"logit_scale": 1.0, "logit_softcap": None}
    try:
        plain_loss = loss_grads_metrics(sage, batch)[0]
    finally:
        sage._logit_options = model_logits
    assert not math.isclose(plain_loss.item(), results[0][0].item(), rel_tol=1e-3, abs_tol=1e-4)


def test_training_steps_with_branch_guide(model_dir, tmp_path):
    trainer = make_trainer(SAGEGRPOTrainer, model_dir, str(tmp_path), sage_guide="branch", sage_tau=0.0)
    assert trainer._loss_config(None).logit_scale == logit_options(trainer.model.config)["logit_scale"]
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "sage/q_mean" in entry]
    assert len(logs) == 2
    for entry in logs:
        assert math.isfinite(entry["loss"]) and 0.6 <= entry["sage/q_min"] <= entry["sage/q_max"] <= 1.4
        assert math.isfinite(entry["kl"]) and entry["entropy"] > 0
    assert any(not torch.equal(p, q) for p, q in zip(before, trainer.model.parameters()))


@pytest.mark.parametrize(
    "keys, expected",
    [
        ({}, (1.0, None)),
        ({"final_logit_softcapping": 30.0}, (1.0, 30.0)),
        ({"logit_scale": 0.0625}, (0.0625, None)),
        ({"logit_scale": None, "output_multiplier": 2.0}, (2.0, None)),
        ({"lm_head_multiplier": 0.5, "final_logit_softcapping": 10.0}, (0.5, 10.0)),
        ({"logits_scaling": 8.0, "model_type": "granite"}, (0.125, None)),
        ({"logits_scaling": 8.0, "model_type": "hyperclovax"}, (8.0, None)),
        ({"logit_scale": 3.0, "logits_scaling": 8.0}, (3.0, None)),
    ],
)
def test_logit_options_read_the_keys_trl_reads(keys, expected):
    options = logit_options(SimpleNamespace(**keys))
    assert (options["logit_scale"], options["logit_softcap"]) == expected

"""Importance weights against the distribution the engine reports, with the hf engine's sampler.

The engines report log-probs of the temperature-scaled distribution before top-k / top-p / min-p
truncation (`sage_train.rollout.base`), the trainer's quantity: where the sampler and the trainer
hold the same weights every weight is 1, min_p on or not. Against the truncated distribution the
weight of a token would be the probability mass the cut kept (< 1 at uncertain positions)."""

import pytest
import torch
from tiny_models import tiny_model

from sage_train.config import ConfigError
from sage_train.inputs import run_settings
from sage_train.models.loading import build_char_tokenizer
from sage_train.policy import PolicyHead, make_batch, score
from sage_train.rl_maths import rollout_correction
from sage_train.rollout import SamplingParams
from sage_train.rollout.base import Completion
from sage_train.rollout.hf import HFEngine


def peaked_model(tokenizer, seed):
    """A tiny model with a 30x sharper LM head: a random one is nearly uniform over the characters
    (nothing to cut); this one has a few likely tokens per position (entropy ~2 nats)."""
    model = tiny_model(tokenizer, seed=seed)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(30)
    return model


def sampled(temperature, min_p, top_k=0):
    tokenizer = build_char_tokenizer()
    model = peaked_model(tokenizer, seed=2)
    params = SamplingParams(n=4, temperature=temperature, min_p=min_p, top_k=top_k, max_new_tokens=12, seed=1)
    groups = HFEngine(model, tokenizer).generate(["12+34=", "7+8=", "Compute 5*6."], params)
    completions = [c for group in groups for c in group]
    return model, completions, make_batch(completions, torch.device("cpu"), tokenizer.pad_token_id)


@pytest.mark.parametrize("temperature, min_p, top_k", [(1.0, 0.1, 0), (0.7, 0.05, 12)])
def test_weights_are_one_where_sampler_and_trainer_agree(tiny_config, temperature, min_p, top_k):
    model, completions, batch = sampled(temperature, min_p, top_k)
    train_logp, _ = score(PolicyHead(model), batch, 8, temperature)
    cfg = tiny_config(tis_level="token", tis_cap=2.0, temperature=temperature, min_p=min_p, top_k=top_k)
    s = run_settings(cfg)
    weights, metrics = rollout_correction(s.corrections, s.rollout.rollout_engine, completions, train_logp, batch)
    mask = batch.completion_mask
    torch.testing.assert_close(weights[mask], torch.ones(int(mask.sum())), atol=1e-4, rtol=0)
    assert abs(float(metrics["tis/weight_mean"]) - 1) < 1e-4 and float(metrics["tis/clipped_frac"]) == 0

    # the cut was active: every sampled token survived it, and at many positions it removed mass,
    # which weights against the truncated distribution would have taken for a mismatch
    with torch.no_grad():
        logits = model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
        ).logits[:, batch.prompt_length - 1 : -1]
    probs = (logits / temperature).softmax(-1)
    kept = probs >= min_p * probs.max(-1, keepdim=True).values
    if top_k:
        kept &= probs >= probs.topk(top_k, -1).values[..., -1:]
    assert kept.gather(-1, batch.completion_ids[..., None]).squeeze(-1)[mask].all()
    kept_mass = (probs * kept).sum(-1)[mask]
    assert (kept_mass < 0.99).float().mean() > 0.5
    truncated_logp = train_logp[mask] - kept_mass.log()  # what vLLM's processed log-probs report
    assert (train_logp[mask] - truncated_logp).exp().mean() < 0.95


def test_sampler_draws_from_the_truncated_distribution():
    """The first token of 3000 rows against min_p-truncated, renormalised probabilities."""
    tokenizer = build_char_tokenizer()
    model = peaked_model(tokenizer, seed=5)
    min_p = 0.3
    params = SamplingParams(n=3000, max_new_tokens=1, min_p=min_p, seed=0)
    (group,) = HFEngine(model, tokenizer).generate(["3+4="], params)
    ids = torch.tensor([c.completion_ids[0] for c in group])
    prompt = torch.tensor([group[0].prompt_ids])
    with torch.no_grad():
        probs = model(input_ids=prompt).logits[0, -1].softmax(-1)
    target = torch.where(probs >= min_p * probs.max(), probs, 0.0)
    target /= target.sum()
    assert 2 <= int((target > 0).sum()) and set(ids.tolist()) <= set(target.nonzero().flatten().tolist())
    observed = torch.bincount(ids, minlength=len(probs)).float() / len(ids)
    assert (observed - target).abs().max() < 0.03  # ~3.5 standard errors at p = 0.5
    reported = torch.tensor([c.logprobs[0] for c in group])  # the untruncated log-prob of the token
    torch.testing.assert_close(reported, probs.log()[ids], atol=1e-5, rtol=0)


def test_infinite_engine_logprobs_are_refused_and_nan_ones_are_unscored(tiny_config):
    completions = [
        Completion(0, [5, 6], [7, 8], "ab", logprobs=[-0.5, -1.0]),
        Completion(0, [5, 6], [9, 1], "cd", logprobs=[-0.5, float("nan")]),
    ]
    batch = make_batch(completions, torch.device("cpu"), 0)
    s = run_settings(tiny_config(tis_level="token"))
    corrections, engine = s.corrections, s.rollout.rollout_engine
    weights, metrics = rollout_correction(corrections, engine, completions, torch.full((2, 2), -0.2), batch)
    assert weights[1, 1] == 1.0 and weights[0, 1] == 2.0  # NaN: no correction; exp(0.8) capped at 2
    assert float(metrics["rollout_corr/unscored_frac"]) == 0.25
    completions[1].logprobs[1] = float("-inf")
    with pytest.raises(ValueError, match=r"returned 1 infinite log-prob\(s\) \(first in completion 1"):
        rollout_correction(corrections, engine, completions, torch.zeros(2, 2), batch)


def test_config_refuses_truncation_where_vllm_reports_only_truncated_scaled_logprobs(tiny_config):
    with pytest.raises(ConfigError, match="config key 'tis_level' must be 'off' with rollout_engine 'vllm'"):
        tiny_config(rollout_engine="vllm", tis_level="token", temperature=0.7, min_p=0.01)
    with pytest.raises(ConfigError, match="'tis_level'"):
        tiny_config(rollout_engine="vllm", tis_level="sequence", temperature=0.7, top_p=0.9)
    # allowed: temperature 1 (raw log-probs), no truncation, no correction, or the hf engine
    assert tiny_config(rollout_engine="vllm", tis_level="token", temperature=1.0, min_p=0.01).min_p == 0.01
    assert tiny_config(rollout_engine="vllm", tis_level="token", temperature=0.7).temperature == 0.7
    assert tiny_config(rollout_engine="vllm", tis_level="off", temperature=0.7, min_p=0.01).tis_level == "off"
    assert tiny_config(tis_level="token", temperature=0.7, min_p=0.01).rollout_engine == "hf"

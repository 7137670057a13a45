"""The rollout-mismatch toolkit (`sage_train.rl_maths`) against its peers' own code on shared inputs:
TRL 1.16's four ``vllm_importance_sampling_mode``s (the block of ``GRPOTrainer`` that computes them,
run verbatim from the installed trl), verl 0.9.1's IcePop weights, rejection sampler and mismatch
metrics (``rollout_corr_helper``, from its wheel: `peer_source`); NaN engine log-probs; the config
rules; and ``sage-train`` with each mode on the hf engine."""

import ast
import inspect
import math
import textwrap
from types import SimpleNamespace

import pytest
import torch
import yaml
from verl_peer import rollout_corr_helper

from sage_train import report, rl_maths
from sage_train.cli import train_main
from sage_train.config import ConfigError

MODES = rl_maths.IS_MODES[1:]


def mismatch_batch(seed, B=6, L=9, nan=True):
    g = torch.Generator().manual_seed(seed)
    train = torch.log(torch.rand(B, L, generator=g).clamp(0.01, 0.99))
    rollout = train + 0.3 * torch.randn(B, L, generator=g)
    rollout[0] = train[0] + 0.01  # a row near the trainer: inside every bound
    rollout[2, :3] -= 1.5  # and a few tokens far from it (ratio e^1.5, above TRL's default cap 3)
    mask = torch.rand(B, L, generator=g) > 0.25
    mask[:, 0] = True
    mask[-1, 4:] = False
    if nan:
        rollout[1, 2] = rollout[3, 0] = float("nan")  # tokens the engine could not score
    return train, rollout, mask


@pytest.fixture(scope="module")
def trl_block():
    """TRL 1.16's own code that turns old and sampling log-probs into ``vllm_importance_sampling_ratio``."""
    from trl import GRPOTrainer

    tree = ast.parse(textwrap.dedent(inspect.getsource(GRPOTrainer._generate_and_score_completions)))
    (block,) = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.If)
        and ast.unparse(node.test) == "self.use_vllm and self.vllm_importance_sampling_correction"
        and "vllm_importance_sampling_ratio = torch.exp" in ast.unparse(node)
    ]
    code = compile(ast.Module(body=[block], type_ignores=[]), "<trl GRPOTrainer>", "exec")

    def run(old, sampling, mask, mode, clip_min, clip_max):
        trainer = SimpleNamespace(
            use_vllm=True,
            vllm_importance_sampling_correction=True,
            vllm_importance_sampling_mode=mode,
            vllm_importance_sampling_clip_min=clip_min,
            vllm_importance_sampling_clip_max=clip_max,
        )
        scope = dict(self=trainer, torch=torch, math=math, tool_mask=None, completion_mask=mask.float())
        scope.update(old_per_token_logps=old, sampling_per_token_logps=sampling)
        exec(code, scope)
        return scope["vllm_importance_sampling_ratio"]

    return run


@pytest.mark.parametrize("bounds", [(None, 3.0), (0.8, 1.25), (0.9, None)], ids=str)
@pytest.mark.parametrize("mode", MODES)
def test_modes_equal_trl(trl_block, mode, bounds):
    train, rollout, mask = mismatch_batch(1)
    want = trl_block(train, rollout, mask, mode, *bounds).expand(mask.shape)
    weights, outside = rl_maths.is_weights(rl_maths.rollout_log_ratio(train, rollout, mask), mask, mode, *bounds)
    torch.testing.assert_close(weights[mask], want[mask], rtol=1e-6, atol=0)
    assert (weights[~mask] == 1).all()
    assert torch.equal(outside, ((want != weights) | (weights == 0)) & mask) or mode.endswith("truncate")
    assert 0 < int(outside.sum()) < int(mask.sum())  # the bounds bind somewhere, not everywhere
    assert weights[1, 2] == (1.0 if mode.startswith("token") else weights[1, 0])  # NaN: a ratio of 1


@pytest.fixture(scope="module")
def verl():
    return rollout_corr_helper()


def test_icepop_token_mask_equals_verl(verl):
    train, rollout, mask = mismatch_batch(2, nan=False)
    want, _ = verl.compute_rollout_correction_weights(train - rollout, mask.float(), "token", "0.8_1.25")
    weights, outside = rl_maths.is_weights(
        rl_maths.rollout_log_ratio(train, rollout, mask), mask, "token_mask", 0.8, 1.25
    )
    torch.testing.assert_close(weights[mask], want[mask], rtol=1e-6, atol=0)
    assert 0 < int(outside.sum()) < int(mask.sum())


@pytest.mark.parametrize(
    "options, thresholds",
    [
        ("token_k1", "0.8_1.3"),
        ("token_k1", 1.2),
        ("token_k2", 0.02),
        ("token_k3", "0.01"),
        ("seq_sum_k1", "0.5_2.0"),
        ("seq_sum_k3", 0.1),
        ("seq_mean_k1", "0.95_1.05"),
        ("seq_mean_k2", 0.02),
        ("seq_max_k3", 0.05),
        ("token_k1,seq_mean_k3", "0.7_1.4,0.02"),
        ("seq_max_k2,token_k3", 0.03),
    ],
    ids=str,
)
def test_rejection_sampler_equals_verl(verl, options, thresholds):
    train, rollout, mask = mismatch_batch(3, nan=False)
    want, verl_metrics = verl.compute_rollout_rejection_mask(train - rollout, mask.float(), options, thresholds)
    log_ratio = rl_maths.rollout_log_ratio(train, rollout, mask)
    kept = rl_maths.rejection_mask(log_ratio, mask, options, thresholds)
    assert torch.equal(kept, want.bool())
    assert 0 < int((mask & ~kept).sum()) < int(mask.sum())  # something is rejected, not everything
    metrics = rl_maths.mismatch_metrics(train, rollout, mask, kept=kept)
    assert float(metrics["rollout_corr/rejected_frac"]) == pytest.approx(verl_metrics["rollout_rs_masked_fraction"])
    want_rows = verl_metrics["rollout_rs_seq_masked_fraction"]  # verl divides by every row; all have tokens here
    assert float(metrics["rollout_corr/seq_rejected_frac"]) == pytest.approx(want_rows)


def test_mismatch_metrics_equal_verl_and_skip_unscored_tokens(verl):
    train, rollout, mask = mismatch_batch(4, nan=False)
    want = verl.compute_offpolicy_metrics(train, rollout, mask.float())
    metrics = rl_maths.mismatch_metrics(train, rollout, mask)
    assert {"rollout_corr/" + name for name in want} <= set(metrics)
    for name, value in want.items():
        assert float(metrics["rollout_corr/" + name]) == pytest.approx(value, rel=1e-5), name
    # NaN engine log-probs: left out of the means (TRL's choice for its logp-difference metrics)
    unscored = rollout.clone()
    unscored[2, 1] = unscored[4, 0] = float("nan")
    kept = mask.clone()
    kept[2, 1] = kept[4, 0] = False
    with_nan = rl_maths.mismatch_metrics(train, unscored, mask)
    without = rl_maths.mismatch_metrics(train, rollout, kept)
    for name in want:
        assert float(with_nan["rollout_corr/" + name]) == pytest.approx(float(without["rollout_corr/" + name])), name
    assert float(with_nan["rollout_corr/unscored_frac"]) == pytest.approx(2 / float(mask.sum()))


@pytest.mark.parametrize("cap", [1.2, 3.0])
def test_sequence_tis_is_the_product_as_trl_and_verl_weigh_it(trl_block, verl, cap):
    train, rollout, mask = mismatch_batch(6, nan=False)
    weights = rl_maths.truncated_is_weights(train, rollout, mask, level="sequence", cap=cap)
    trl = trl_block(train, rollout, mask, "sequence_truncate", None, cap).expand(mask.shape)
    torch.testing.assert_close(weights[mask], trl[mask], rtol=1e-6, atol=0)
    verl_weights, verl_metrics = verl.compute_rollout_correction_weights(train - rollout, mask.float(), "sequence", cap)
    torch.testing.assert_close(weights[mask], verl_weights[mask], rtol=1e-6, atol=0)
    assert 0 < int((weights[mask] == cap).sum()) < int(mask.sum())  # the cap binds on some rows only
    log_ratio = rl_maths.rollout_log_ratio(train, rollout, mask)
    ours = rl_maths.importance_metrics(log_ratio, mask, weights, "sequence", cap)
    for name, value in verl_metrics.items():
        assert float(ours["rollout_corr/" + name]) == pytest.approx(value, rel=1e-5, abs=1e-7), name


def test_unscored_tokens_are_never_rejected_and_add_nothing_to_sequence_sums():
    train, rollout, mask = mismatch_batch(5)
    log_ratio = rl_maths.rollout_log_ratio(train, rollout, mask)
    assert log_ratio[1, 2] == 0 and log_ratio[3, 0] == 0
    assert rl_maths.rejection_mask(log_ratio, mask, "token_k1", "0.999_1.001")[1, 2]


@pytest.mark.parametrize(
    "keys, word",
    [
        (dict(vllm_importance_sampling_mode="token_clip"), "vllm_importance_sampling_mode"),
        (dict(vllm_importance_sampling_mode="token_mask", tis_level="token"), "vllm_importance_sampling_mode"),
        (dict(vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_max=None), "clip_max"),
        (dict(vllm_importance_sampling_clip_min=2.0, vllm_importance_sampling_clip_max=1.0), "clip_min"),
        (dict(rollout_rs="token_k4", rollout_rs_threshold=1.0), "'rollout_rs'"),
        (dict(rollout_rs="token_k3", rollout_rs_threshold="0.1_0.2"), "'rollout_rs_threshold'"),
        (dict(rollout_rs="token_k1,seq_sum_k3", rollout_rs_threshold="1,2,3"), "'rollout_rs_threshold'"),
        (dict(rollout_rs_threshold=0.5), "'rollout_rs_threshold'"),
        (
            dict(rollout_engine="vllm", vllm_importance_sampling_mode="token_mask", temperature=0.7, top_p=0.9),
            "'vllm_importance_sampling_mode' must be 'off' with rollout_engine 'vllm'",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_mismatch_options_name_the_key(tiny_config, keys, word):
    with pytest.raises(ConfigError, match=word):
        tiny_config(**keys)


SAGE_TRAIN_CASES = {
    **{
        mode: {
            "vllm_importance_sampling_mode": mode,
            "vllm_importance_sampling_clip_min": 0.999,
            "vllm_importance_sampling_clip_max": 1.001,
        }
        for mode in MODES
    },
    "rejection": {"rollout_rs": "token_k1,seq_max_k3", "rollout_rs_threshold": "0.999_1.001,0.001"},
    "tis-sequence": {"tis_level": "sequence", "tis_cap": 1.001},
}
OFFPOLICY_NAMES = [
    "training_ppl",
    "training_log_ppl",
    "kl",
    "k3_kl",
    "rollout_ppl",
    "rollout_log_ppl",
    "log_ppl_diff",
    "log_ppl_abs_diff",
    "log_ppl_diff_max",
    "log_ppl_diff_min",
    "ppl_ratio",
    "chi2_token",
    "chi2_seq",
]
IS_NAMES = ["rollout_is_mean", "rollout_is_std", "rollout_is_max", "rollout_is_min", "rollout_is_eff_sample_size"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SAGE_TRAIN_CASES))
def test_sage_train_runs_each_mode_on_the_hf_engine(tmp_path, distributed, tiny_run, name):
    """Two steps from the command line, sampling from a bfloat16 copy (a real engine/trainer mismatch)
    with bounds tight enough to bind."""
    path = tmp_path / "run.yaml"
    run = {**tiny_run, "output_dir": str(tmp_path), "name": "mismatch", "steps": 2, "hf_rollout_dtype": "bfloat16"}
    path.write_text(yaml.safe_dump({**run, **SAGE_TRAIN_CASES[name]}))
    algorithm = "sage-branch-dppo" if name == "rejection" else "sage-branch"
    assert train_main(["--config", str(path), f"--algorithm={algorithm}"]) == 0
    rows = report.read_metrics(tmp_path / "mismatch" / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert row["rollout_corr/k3_kl"] > 0 and row["rollout_corr/unscored_frac"] == 0  # bf16 vs fp32
        logged = [f"rollout_corr/{n}" for n in OFFPOLICY_NAMES + (IS_NAMES if name != "rejection" else [])]
        assert all(math.isfinite(row[key]) for key in logged)  # verl's names, each logged
        flagged = [v for k, v in row.items() if k.startswith("rollout_corr/") and k.endswith("ed_frac")]
        assert flagged and 0 < max(flagged) <= 1
        assert math.isfinite(row["loss"])

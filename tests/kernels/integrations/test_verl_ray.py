"""The ``"sage"`` policy loss reaches a verl Ray worker by configuration alone: verl's own trainer
config (``ppo_trainer``, composed by Hydra as ``verl.trainer.main_ppo`` composes it) with
``actor_rollout_ref.model.external_lib=sage_kernels.integrations.verl`` and
``actor_rollout_ref.actor.policy_loss.loss_mode=sage``, sent to a fresh Ray worker process
(``ray.init(num_cpus=2)``, on CPU). There the worker does what verl's engine worker does:
``init_model`` turns ``config.model`` into verl's ``HFModelConfig`` (whose ``__post_init__`` imports
``external_lib``), and verl's ``ppo_loss`` looks the loss up with ``get_policy_loss_fn(loss_mode)``.
Nothing in the worker imports sage before that; its loss and gradient equal ours computed here.

Runs where verl imports (`make verl-suite`); ray starts in seconds, so it stays out of `make test`.
"""

import os
import sys
from pathlib import Path

import pytest
import torch
from verl_peer import verl_installed

pytestmark = pytest.mark.skipif(not verl_installed(), reason="verl is not installed here (make verl-suite)")
ENTRY = "sage_kernels.integrations.verl"


def verl_trainer_config(model_dir: Path, loss_mode: str = "sage"):
    """verl's ``ppo_trainer`` config as its launcher composes it, with the command-line overrides a user
    passes: the only mention of sage is `ENTRY` and the loss mode."""
    import verl
    from hydra import compose, initialize_config_dir

    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    overrides = [
        f"actor_rollout_ref.model.path={model_dir}",
        f"actor_rollout_ref.model.external_lib={ENTRY}",
        f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.clip_ratio_high=0.28",
    ]
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose("ppo_trainer", overrides=overrides)


def worker_policy_loss(actor_rollout_ref, inputs: dict) -> dict:
    """In the Ray worker: verl's own steps from its config to the policy loss's value and gradient."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, get_policy_loss_fn
    from verl.utils.config import omega_conf_to_dataclass

    before = {"imported": ENTRY in sys.modules, "registered": "sage" in POLICY_LOSS_REGISTRY}
    omega_conf_to_dataclass(actor_rollout_ref.model)  # ActorRolloutRefWorker.init_model's first step
    actor = omega_conf_to_dataclass(actor_rollout_ref.actor)
    loss_fn = get_policy_loss_fn(actor.policy_loss.loss_mode)  # as verl.workers.utils.losses.ppo_loss
    log_prob = inputs["log_prob"].clone().requires_grad_(True)
    loss, metrics = loss_fn(
        old_log_prob=inputs["old_log_prob"],
        log_prob=log_prob,
        advantages=inputs["advantages"],
        response_mask=inputs["response_mask"],
        loss_agg_mode=actor.loss_agg_mode,
        config=actor,
        rollout_is_weights=None,
    )
    loss.backward()
    return dict(
        before=before,
        loss_fn=f"{loss_fn.__module__}.{loss_fn.__qualname__}",
        loss=loss.detach(),
        grad=log_prob.grad,
        metrics=metrics,
        pid=os.getpid(),
        clip=(actor.clip_ratio_low, actor.clip_ratio_high, actor.loss_agg_mode),
    )


@pytest.fixture(scope="module")
def ray_local():
    import ray
    from ray import cloudpickle

    # the worker function travels by value: the worker does not import this test module (nor sage)
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_external_lib_registers_sage_in_a_ray_worker(ray_local, tiny_lm_dir):
    config = verl_trainer_config(tiny_lm_dir)
    g = torch.Generator().manual_seed(0)
    B, L = 4, 6
    inputs = dict(
        old_log_prob=-torch.rand(B, L, generator=g) * 3,
        log_prob=-torch.rand(B, L, generator=g) * 3,
        advantages=torch.randn(B, 1, generator=g).expand(B, L).contiguous(),
        response_mask=torch.ones(B, L, dtype=torch.bool),
    )
    inputs["response_mask"][1, 3:] = False
    got = ray_local.get(ray_local.remote(worker_policy_loss).remote(config.actor_rollout_ref, inputs))

    assert got["pid"] != os.getpid()
    assert got["before"] == {"imported": False, "registered": False}  # the config alone brought it
    assert got["loss_fn"] == f"{ENTRY}.compute_policy_loss_sage"
    from sage_kernels.integrations import verl as sage_verl

    low, high, mode = got["clip"]
    assert (low, high) == (0.2, 0.28)
    log_prob = inputs["log_prob"].clone().requires_grad_(True)
    config = dict(clip_ratio=0.2, clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=3.0, global_batch_info={})
    loss, metrics = sage_verl.compute_policy_loss_sage(
        inputs["old_log_prob"], log_prob, inputs["advantages"], inputs["response_mask"], mode, config
    )
    loss.backward()
    torch.testing.assert_close(got["loss"], loss.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got["grad"], log_prob.grad, rtol=1e-6, atol=1e-7)
    assert got["metrics"] == pytest.approx(metrics)
    assert loss.item() != 0 and metrics["actor/pg_clipfrac"] > 0  # the clip binds: a real case

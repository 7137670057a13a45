"""Run an OpenRLHF entry point with `SAGEPolicyLoss` in place of OpenRLHF's ``PolicyLoss``, in the
driver and in every Ray worker, with no OpenRLHF file edited::

    python -m sage_kernels.integrations.openrlhf_launch [--loss_type dppo_tv] [--loss_options '{"tau": 0.8}'] \\
        openrlhf.cli.train_ppo_ray <OpenRLHF's arguments>

- An import hook replaces ``PolicyLoss`` in ``openrlhf.models.loss`` as soon as that module has run,
  so ``from openrlhf.models import PolicyLoss`` (OpenRLHF's ``ppo_actor``) binds `SAGEPolicyLoss`
  with the chosen ``loss_type`` and `LossConfig` options; OpenRLHF's constructor arguments (clip
  range, dual clip, policy_loss_type, the train/rollout correction) pass through unchanged.
- With ``--fused_actor``, every OpenRLHF ``Actor`` (policy, EMA, reference) runs the fused LM head
  (`patch_actor_forward` at the end of its ``__init__``): no [B, T, V] fp32 logits.
- The choice travels in the environment variable ``SAGE_OPENRLHF_LOSS`` (JSON), and ``ray.init`` is
  wrapped to add to its ``runtime_env`` that variable and the ``worker_process_setup_hook``
  `worker_setup`, which installs the same hook in each Ray worker before it runs a task or actor.
  ``ray.init``'s own ``runtime_env`` is kept; one with a ``worker_process_setup_hook`` of its own is
  refused. Without the launcher (``ray job submit``), pass `runtime_env` 's dict as the job's.
"""

from __future__ import annotations

import argparse
import functools
import importlib.abc
import importlib.machinery
import json
import os
import runpy
import sys

from .openrlhf import SAGEPolicyLoss, patch_actor_forward

#: the environment variable holding {"loss_type": ..., "loss_options": {...}} for the workers
ENV = "SAGE_OPENRLHF_LOSS"
#: OpenRLHF's modules defining PolicyLoss and Actor, and the hook Ray's workers run
TARGET = "openrlhf.models.loss"
ACTOR_TARGET = "openrlhf.models.actor"
SETUP_HOOK = "sage_kernels.integrations.openrlhf_launch.worker_setup"

_installed: dict = {}


def policy_loss_class(loss_type: str = "grpo", **loss_options) -> type:
    """A `SAGEPolicyLoss` named ``PolicyLoss`` taking OpenRLHF's constructor arguments, with
    `loss_type` and `loss_options` fixed (checked now: a bad option fails here, not in a worker)."""
    SAGEPolicyLoss(loss_type=loss_type, **loss_options)

    class PolicyLoss(SAGEPolicyLoss):
        sage_loss = (loss_type, dict(loss_options))

        def __init__(self, *args, **kwargs):
            super().__init__(*args, loss_type=loss_type, **loss_options, **kwargs)

    PolicyLoss.__module__ = __name__
    return PolicyLoss


def fuse_actor_class(actor_cls) -> None:
    """Make every new instance of `actor_cls` (OpenRLHF's ``Actor``) run `patch_actor_forward` at the
    end of its ``__init__``: the policy, its EMA copy and the reference model then run the fused head.
    A vision model is refused (the fused forward takes no image inputs)."""
    if getattr(actor_cls.__init__, "_sage_fused", False):
        return
    init = actor_cls.__init__

    @functools.wraps(init)
    def fused_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if getattr(self, "is_vlm", False):
            raise ValueError("--fused_actor: the fused forward takes text models only; this Actor is a vision model")
        patch_actor_forward(self)

    fused_init._sage_fused = True
    actor_cls.__init__ = fused_init


def _targets() -> tuple:
    return (TARGET, ACTOR_TARGET) if _installed.get("fused_actor") else (TARGET,)


class _Loader(importlib.abc.Loader):
    """OpenRLHF's own loader of a module of `_targets`, then ``PolicyLoss`` replaced in it (`TARGET`)
    or its ``Actor`` fused (`ACTOR_TARGET`)."""

    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        if module.__name__ == ACTOR_TARGET:
            fuse_actor_class(module.Actor)
        else:
            _installed["original"] = module.PolicyLoss
            module.PolicyLoss = _installed["class"]

    def __getattr__(self, name):  # get_source, get_filename, ... for tracebacks and inspect
        return getattr(self.inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _targets():
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install(loss_type: str = "grpo", *, fused_actor: bool = False, **loss_options) -> type:
    """Make OpenRLHF's ``PolicyLoss`` this process's `policy_loss_class`, and with `fused_actor` its
    ``Actor`` fused (`fuse_actor_class`; not undone by a later call); returns the class. Before
    OpenRLHF is imported, through the import hook; after, by replacing the class in every loaded
    ``openrlhf`` module that holds OpenRLHF's."""
    stale = [_installed["class"]] if "class" in _installed else []
    _installed["class"] = cls = policy_loss_class(loss_type, **loss_options)
    _installed["fused_actor"] = _installed.get("fused_actor", False) or fused_actor
    if fused_actor and ACTOR_TARGET in sys.modules:
        fuse_actor_class(sys.modules[ACTOR_TARGET].Actor)
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    loaded = sys.modules.get(TARGET)
    if loaded is not None:
        stale.append(_installed.setdefault("original", loaded.PolicyLoss))
        for name, module in list(sys.modules.items()):
            if name.split(".")[0] == "openrlhf" and getattr(module, "PolicyLoss", None) in stale:
                module.PolicyLoss = cls
    return cls


def choice(loss_type: str = "grpo", loss_options: dict | None = None, fused_actor: bool = False) -> str:
    """The JSON value of `ENV` for `install` 's arguments."""
    return json.dumps({"loss_type": loss_type, "loss_options": dict(loss_options or {}), "fused_actor": fused_actor})


def worker_setup() -> None:
    """Ray's ``worker_process_setup_hook``: `install` what `ENV` names (nothing without it)."""
    value = os.environ.get(ENV)
    if value:
        chosen = json.loads(value)
        install(chosen["loss_type"], fused_actor=chosen.get("fused_actor", False), **chosen["loss_options"])


def runtime_env(base=None, value: str | None = None) -> dict:
    """`base` (a Ray runtime_env, or None) with `ENV` (`value`, else this process's) among its
    env_vars and `worker_setup` as its ``worker_process_setup_hook``."""
    env = dict(base or {})
    hook = env.get("worker_process_setup_hook")
    if hook not in (None, SETUP_HOOK):
        raise ValueError(f"runtime_env already has a worker_process_setup_hook ({hook!r}); the launcher sets its own")
    value = os.environ[ENV] if value is None else value
    env["env_vars"] = {**dict(env.get("env_vars") or {}), ENV: value}
    env["worker_process_setup_hook"] = SETUP_HOOK
    return env


def wrap_ray_init(ray) -> None:
    """Make `ray` 's ``init`` pass `runtime_env` (of its own runtime_env argument) to Ray."""
    if getattr(ray.init, "_sage_runtime_env", False):
        return
    original = ray.init

    @functools.wraps(original)
    def init(*args, **kwargs):
        kwargs["runtime_env"] = runtime_env(kwargs.get("runtime_env"))
        return original(*args, **kwargs)

    init._sage_runtime_env = True
    ray.init = init


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m sage_kernels.integrations.openrlhf_launch",
        description="Run an OpenRLHF module (e.g. openrlhf.cli.train_ppo_ray) with SAGEPolicyLoss as PolicyLoss, "
        "in the driver and in its Ray workers.",
    )
    parser.add_argument("--loss_type", default="grpo", help="the LossConfig loss type (default grpo)")
    parser.add_argument("--loss_options", default="{}", help="a JSON object of further LossConfig options")
    parser.add_argument(
        "--fused_actor",
        action="store_true",
        help="OpenRLHF's Actor runs the fused LM head (patch_actor_forward): no [B, T, V] logits",
    )
    parser.add_argument("module", help="the OpenRLHF module to run as __main__")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    ns = parser.parse_args(argv)
    try:
        options = json.loads(ns.loss_options)
    except json.JSONDecodeError as error:
        parser.error(f"--loss_options must be a JSON object: {error}")
    if not isinstance(options, dict):
        parser.error(f"--loss_options must be a JSON object, got {ns.loss_options!r}")
    try:
        install(ns.loss_type, fused_actor=ns.fused_actor, **options)
    except (TypeError, ValueError) as error:
        parser.error(f"--loss_type/--loss_options: {error}")
    os.environ[ENV] = choice(ns.loss_type, options, ns.fused_actor)
    try:
        import ray
    except ImportError:
        ray = None  # a module that never starts Ray needs only the import hook
    if ray is not None:
        wrap_ray_init(ray)
    sys.argv = [ns.module, *ns.args]
    runpy.run_module(ns.module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    # the module's importable copy, not this __main__ one: the hook state and SETUP_HOOK live there
    from sage_kernels.integrations.openrlhf_launch import main as _main

    _main()

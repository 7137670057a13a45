"""The launcher's Ray test driver (test_openrlhf_launch.py), run as ``python -m
sage_kernels.integrations.openrlhf_launch ... openrlhf_ray_driver OUT``. It does what OpenRLHF's
driver does and nothing more: a plain ``ray.init`` (on 2 CPUs), then a Ray actor that imports
OpenRLHF's ``PolicyLoss`` from ``openrlhf.models`` as OpenRLHF's ``ppo_actor`` does and runs the
cases of openrlhf_policy_cases on the padded and packing_samples layouts. OUT receives what the
actor and the driver saw (torch.save)."""

import os
import sys

import ray
import torch


def main(out: str) -> None:
    ray.init(num_cpus=2, include_dashboard=False)

    @ray.remote(num_cpus=1)
    class Learner:
        def run(self):
            import openrlhf_policy_cases as cases
            from openrlhf.models import PolicyLoss

            padded = cases.padded_batch()
            packed = cases.packed_batch(padded)
            return dict(
                pid=os.getpid(),
                name=f"{PolicyLoss.__module__}.{PolicyLoss.__name__}",
                sage_loss=getattr(PolicyLoss, "sage_loss", None),
                shapes={"padded": tuple(padded["action_mask"].shape), "packed": tuple(packed["action_mask"].shape)},
                results={"padded": cases.run(PolicyLoss, padded), "packed": cases.run(PolicyLoss, packed)},
            )

    report = ray.get(Learner.remote().run.remote())
    from openrlhf.models import PolicyLoss

    report["driver"] = dict(pid=os.getpid(), sage_loss=getattr(PolicyLoss, "sage_loss", None))
    torch.save(report, out)
    ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])

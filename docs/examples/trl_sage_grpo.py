"""GRPO with the SAGE loss in TRL: `SAGEGRPOConfig` + `SAGEGRPOTrainer` in place of TRL's pair.

Run: python docs/examples/trl_sage_grpo.py [model] (default Qwen/Qwen2.5-0.5B-Instruct).
"""

import sys

from datasets import Dataset

from sage_kernels.integrations.trl import SAGEGRPOConfig, SAGEGRPOTrainer


def shortest(completions, **kwargs):
    return [-len(completion) / 100 for completion in completions]


def main(model="Qwen/Qwen2.5-0.5B-Instruct", output_dir="sage-grpo", max_steps=10, **overrides):
    dataset = Dataset.from_dict({"prompt": ["2+2=", "3+5=", "7+1=", "4+4="]})
    args = SAGEGRPOConfig(
        output_dir=output_dir, max_steps=max_steps, report_to="none",
        per_device_train_batch_size=4, num_generations=4, max_completion_length=16,
        beta=0.04, loss_type="dapo", epsilon_high=0.28,        # TRL's options, TRL's meaning
        sage_guide="branch", sage_gamma=0.3, sage_tau=1.2,     # SAGE: anchor q * pi_ref
        **overrides)
    trainer = SAGEGRPOTrainer(model=model, reward_funcs=shortest, args=args, train_dataset=dataset)
    trainer.train()
    return trainer


if __name__ == "__main__":
    main(*sys.argv[1:2])

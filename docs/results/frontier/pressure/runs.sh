#!/bin/sh
# short measurement runs of the per-token pressure on stage 3's seed-600 warm start (not registered)
cd /work/wt/study
for spec in "grpo-b0.05 grpo 0.05" "active-b0.05 sage-branch 0.05" "grpo-b0.2 grpo 0.2" "active-b0.2 sage-branch 0.2"; do
  set -- $spec
  SAGE_CPU_NATIVE=0 PYTHONPATH=$PWD OMP_NUM_THREADS=1 nice -n 15 /work/main/.venv/bin/sage-train --config tiny-cpu --model=/work/stage3/runs/start-s600/sft \
    --sft_steps=0 --task=arithmetic --task_options='{"digits": 2, "ops": "+", "grading": "strict"}' --train_problems=1000 \
    --max_new_tokens=8 --steps=40 --prompts_per_step=32 --group_size=8 --micro_batch_size=64 --lr=0.0003 --warmup_steps=20 \
    --seed=600 --algorithm=$2 --tau=0.076 --gamma=0.285 --beta=$3 --eval_problems=0 --output_dir=/tmp/pressure --name=$1 \
    --progress=false --plots=false --report_to='[]' --overwrite=true > /tmp/pressure/$1.log 2>&1
done

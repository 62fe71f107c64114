#!/usr/bin/env bash
# GRPO on gsm8k-style data with verl, rollouts drafted by rollout-spec (one GPU).
#   pip install "rollout-spec[verl,sglang,workloads]"   # or [verl,vllm,workloads], ROLLOUT=vllm
#   python examples/verl/make_gsm_data.py --out ~/data/gsm_symbolic   # the default $DATA
#   (another folder: `export DATA=/that/folder` first and pass --out "$DATA" above)
#   bash examples/verl/run_grpo_smollm2.sh [extra hydra overrides]
# The two `custom` lines are the whole integration; drop them to compare against plain decoding.
# With several rollout replicas, add `shared_index: my-job` inside custom.rollout_spec: every
# replica's drafter then also learns from the others' samples (docs/scale_out.md).
set -euo pipefail
DATA=${DATA:-$HOME/data/gsm_symbolic}
MODEL=${MODEL:-HuggingFaceTB/SmolLM2-135M-Instruct}   # or Qwen/Qwen2.5-0.5B-Instruct
ROLLOUT=${ROLLOUT:-sglang}                            # sglang | vllm

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    algorithm.use_kl_in_reward=False \
    data.train_files="$DATA/train.parquet" \
    data.val_files="$DATA/test.parquet" \
    data.train_batch_size=64 \
    data.max_prompt_length=512 \
    data.max_response_length=512 \
    actor_rollout_ref.model.path="$MODEL" \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=32 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.rollout.name="$ROLLOUT" \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.5 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16 \
    +actor_rollout_ref.rollout.custom.speculative=rollout_spec \
    +actor_rollout_ref.rollout.custom.rollout_spec='{num_draft_tokens: 8, max_depth: 24, history_steps: 4}' \
    trainer.logger='["console","wandb"]' \
    trainer.project_name=rollout-spec \
    trainer.experiment_name="grpo-smollm2-$ROLLOUT-rollout_spec" \
    trainer.n_gpus_per_node=1 \
    trainer.nnodes=1 \
    trainer.save_freq=-1 \
    trainer.test_freq=10 \
    trainer.total_epochs=1 \
    "$@"

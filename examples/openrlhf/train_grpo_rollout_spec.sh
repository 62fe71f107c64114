#!/usr/bin/env bash
# GRPO on one 2-GPU node with OpenRLHF 0.11 + vLLM 0.29, rollouts drafted by rollout-spec.
# Needs: pip install 'rollout-spec[openrlhf,workloads]' on every node, a running Ray cluster
# (ray start --head --num-gpus 2) and the model reachable from the nodes.
# BASELINE=1 runs the same training without speculation (the baseline to compare with).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
MODEL="${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}"
BASELINE="${BASELINE:-0}"
if [[ "$BASELINE" != 0 && "$BASELINE" != 1 ]]; then
  echo "BASELINE must be 0 (speculation on) or 1 (the baseline without it), got '$BASELINE'" >&2
  exit 2
fi
RUN_NAME=$([[ "$BASELINE" == 1 ]] && echo grpo_baseline || echo grpo_rollout_spec)
OUT="${OUT:-$HERE/runs/$RUN_NAME}"  # each run its own checkpoints and logs
PROMPTS="$OUT/prompts.jsonl"

python "$HERE/make_prompts.py" --out "$PROMPTS" --size 256

# shared_index: the engines' drafters also learn from each other's samples (docs/scale_out.md)
ROLLOUT_SPEC_ARGS=(
  --rollout_spec
  --rollout_spec.num_draft_tokens 8
  --rollout_spec.group_weight 2.0
  --rollout_spec.history_steps 4
  --rollout_spec.shared_index grpo-index
)
if [[ "$BASELINE" == 1 ]]; then
  ROLLOUT_SPEC_ARGS=()
fi

OPENRLHF_ARGS=(
  --actor.model_name_or_path "$MODEL"
  --actor.num_nodes 1 --actor.num_gpus_per_node 2
  --ref.num_nodes 1 --ref.num_gpus_per_node 2
  --vllm.num_engines 2 --vllm.tensor_parallel_size 1 --vllm.gpu_memory_utilization 0.5
  --train.colocate_all --vllm.enable_sleep --ds.enable_sleep
  --reward.remote_url "$HERE/reward_func.py"
  --data.prompt_dataset "$PROMPTS" --data.input_key prompt --data.label_key label
  --data.apply_chat_template --data.max_len 2048 --rollout.max_new_tokens 1024
  --rollout.batch_size 32 --rollout.n_samples_per_prompt 8 --rollout.micro_batch_size 8
  --rollout.temperature 1.0
  --train.batch_size 256 --train.micro_batch_size 4 --train.max_epochs 1 --train.num_episodes 1
  --algo.advantage.estimator group_norm --algo.kl.init_coef 0.0
  --actor.adam.lr 1e-6 --ds.zero_stage 2 --ds.param_dtype bf16
  --actor.gradient_checkpointing_enable
  --ckpt.output_dir "$OUT/ckpt" --ckpt.save_steps -1
  --logger.logging_steps 1 --eval.steps -1
  --logger.tensorboard_dir "$OUT/tensorboard"
  ${WANDB_API_KEY:+--logger.wandb.key "$WANDB_API_KEY" --logger.wandb.project rollout_spec_openrlhf}
)

# (the +"..." form: an empty array is "unbound" to set -u before bash 4.4)
python -m rollout_spec.integrations.openrlhf.train_ppo_ray ${ROLLOUT_SPEC_ARGS[@]+"${ROLLOUT_SPEC_ARGS[@]}"} \
  "${OPENRLHF_ARGS[@]}"

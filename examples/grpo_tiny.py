"""A real, tiny GRPO loop: rollouts through rollout-spec's engine with speculation, updates with AdamW.

Each step: P reasoning-gym prompts x n samples from the engine (speculation on; optionally the
same step without it for the speedup), rewards from the task's own checker, group-normalised
advantages, one policy-gradient update of a transformers copy of the model, and the new weights
copied into the engine's model in place. The drafter keeps learning from every step's rollouts
while the policy changes, which is the point of a model-free drafter.

    python examples/grpo_tiny.py --steps 20 --prompts 16 --n 8           # GPU: a few minutes
    python examples/grpo_tiny.py --device cpu --steps 1 --prompts 2 --n 2 --max-new-tokens 16
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from rollout_spec.cli_args import (DefaultsParser, check_device, device_arg, float_arg, int_arg, model_arg,
                                   task_arg)
from rollout_spec.config import DEFAULT_MODEL, MIN_TEMPERATURE, SamplingParams, SpecConfig
from rollout_spec.metrics import (DrafterProbe, make_sink, resolve_wandb_mode, stats_from_outputs,
                                  wandb_metrics)
from rollout_spec.workloads import Prompt, Workload, extract_final_answer

RewardFn = Callable[[Prompt, str, Sequence[int]], float]


@dataclass
class Rollouts:
    """One step's samples: prompt rows, responses, the engine's logprobs, rewards, advantages."""

    prompts: list[Prompt]
    outputs: list[Any]
    rewards: torch.Tensor
    advantages: torch.Tensor
    seconds: float
    """Wall time of the engine's generate call alone (scoring excluded)."""


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Command-line options of the example, every one checked before any model is built."""
    from rollout_spec.cli import check_task_pool

    p = DefaultsParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=model_arg, default=DEFAULT_MODEL)
    p.add_argument("--device", type=device_arg, default="auto", help="auto, cpu, mps, cuda or cuda:N")
    p.add_argument("--task", type=task_arg, default="basic_arithmetic")
    p.add_argument("--steps", type=int_arg("--steps", 1, 100_000), default=10)
    p.add_argument("--prompts", type=int_arg("--prompts", 1, 100_000), default=8)
    p.add_argument("--n", type=int_arg("--n", 2, 1024), default=8,
                   help="samples per prompt (>= 2: a group of one has no advantage signal)")
    p.add_argument("--max-new-tokens", type=int_arg("--max-new-tokens", 1, 1 << 20), default=192)
    p.add_argument("--temperature", type=float_arg("--temperature", MIN_TEMPERATURE, 100.0), default=1.0,
                   help="> 0: greedy samples of a group agree, so they carry no advantage signal")
    p.add_argument("--draft-tokens", type=int_arg("--draft-tokens", 1, 1024), default=8)
    p.add_argument("--lr", type=float_arg("--lr", 0.0, 1.0, lo_open=True), default=1e-6)
    p.add_argument("--micro-batch", type=int_arg("--micro-batch", 1, 1 << 16), default=8)
    p.add_argument("--format-bonus", type=float_arg("--format-bonus", 0.0, 10.0), default=0.1,
                   help="reward added when the reply states a final answer ('#### ...')")
    p.add_argument("--max-batch", type=int_arg("--max-batch", 1, 1 << 16), default=256,
                   help="most requests decoded at once")
    p.add_argument("--no-baseline", action="store_true", help="skip the speculation-off pass")
    p.set_defaults(fresh_prompts=False)  # the same prompt pool every step, as in epochs
    p.add_argument("--wandb", choices=("offline", "online", "disabled"), default=None)
    p.add_argument("--seed", type=int_arg("--seed", 0, 2**62), default=0)
    args = p.parse_args(argv)
    args.device = check_device(p, args.device)
    check_task_pool(p, args)  # the prompts can be made (humaneval's pool, the task's generator)
    try:
        args.wandb = resolve_wandb_mode(args.wandb)
    except ValueError as exc:
        p.error(f"--wandb: {exc}")
    return args


def load(args: argparse.Namespace) -> tuple[Any, Optional[Any], torch.nn.Module]:
    """The speculative engine, a plain engine on the same weights, and the trainable policy."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout_spec.cli import engine_sizes, loading_model
    from rollout_spec.engine import RolloutEngine
    from rollout_spec.engine.weights import load_config, resolve_model_dir

    with loading_model(args.model):
        model_dir = str(resolve_model_dir(args.model))
        limit = load_config(Path(model_dir)).max_position_embeddings
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    sizes = engine_sizes(args, tokenizer, limit)
    with loading_model(args.model):
        # fp32 on every device: the engine's weights are copied from the policy after each update.
        engine = RolloutEngine.from_pretrained(model_dir, device=args.device, dtype=torch.float32,
                                               spec=SpecConfig(num_draft_tokens=args.draft_tokens), **sizes)
        policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(engine.device)
    engine.drafter = DrafterProbe(engine.drafter)
    base = None if args.no_baseline else RolloutEngine(
        engine.model, engine.tokenizer, None, eos_token_ids=engine.eos_token_ids, **sizes)
    return engine, base, policy


@torch.no_grad()
def sync_weights(engine: Any, policy: torch.nn.Module) -> int:
    """Copy the policy's weights into the engine's model in place; returns tensors copied.

    In place keeps every parameter's storage, so anything holding pointers to them (CUDA graphs,
    the shared baseline engine) sees the new policy without a rebuild.
    """
    source = policy.state_dict()
    copied = 0
    for name, param in engine.model.named_parameters():  # tied lm_head is listed once
        key = name if name.startswith("lm_head.") else f"model.{name}"
        if key not in source:
            raise KeyError(f"policy has no tensor {key!r} for the engine's {name!r}")
        param.copy_(source[key].to(param.dtype))
        copied += 1
    return copied


def group_advantages(rewards: torch.Tensor, n: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages: each reward minus its group's mean, over the group's std (rows of n)."""
    groups = rewards.view(-1, n)
    std = groups.std(dim=1, keepdim=True, unbiased=False)
    return ((groups - groups.mean(dim=1, keepdim=True)) / (std + eps)).view(-1)


def task_reward(workload: Workload, bonus: float) -> RewardFn:
    """The task checker's score plus ``bonus`` for stating a final answer at all."""

    def reward(prompt: Prompt, text: str, _ids: Sequence[int]) -> float:
        return workload.score(prompt, text) + (bonus if extract_final_answer(text) else 0.0)

    return reward


def rollout(engine: Any, prompts: list[Prompt], params: SamplingParams, reward_fn: RewardFn) -> Rollouts:
    """Sample n responses per prompt through the engine and score them."""
    start = time.perf_counter()
    outputs = engine.generate([list(p.prompt_ids) for p in prompts], params,
                              group_ids=[p.group_id for p in prompts])
    seconds = time.perf_counter() - start
    texts = engine.tokenizer.batch_decode([o.token_ids for o in outputs], skip_special_tokens=True)
    rewards = torch.tensor([reward_fn(prompts[o.prompt_index], t, o.token_ids)
                            for o, t in zip(outputs, texts)], dtype=torch.float32)
    return Rollouts(prompts, outputs, rewards, group_advantages(rewards, params.n), seconds)


def _padded_batch(rows: list[tuple[list[int], list[int]]], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Right-padded prompt+response ids, attention mask, and a mask of response positions."""
    width = max(len(p) + len(r) for p, r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attn = torch.zeros(len(rows), width, dtype=torch.long)
    resp = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, (p, r) in enumerate(rows):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        attn[i, : len(p) + len(r)] = 1
        resp[i, len(p) : len(p) + len(r)] = True
    return ids.to(device), attn.to(device), resp.to(device)


def token_logprobs(policy: torch.nn.Module, rows: list[tuple[list[int], list[int]]],
                   temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of each response token under the policy ([B, W-1]) and their mask."""
    ids, attn, resp = _padded_batch(rows, next(policy.parameters()).device)
    logits = policy(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    if temperature > 0:  # the engine samples from logits / T, so the ratio must use the same law
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return logp, resp[:, 1:]


def grpo_update(policy: torch.nn.Module, opt: torch.optim.Optimizer, batch: Rollouts,
                temperature: float, micro_batch: int) -> dict[str, float]:
    """One token-level policy-gradient step: loss = -sum(A_i * log p(y_i,t)) / response tokens."""
    keep = [i for i, a in enumerate(batch.advantages.tolist()) if a != 0.0]
    total_tokens = max(sum(len(batch.outputs[i].token_ids) for i in keep), 1)
    opt.zero_grad(set_to_none=True)
    loss_sum, gap_sum = 0.0, 0.0
    for start in range(0, len(keep), micro_batch):
        idx = keep[start : start + micro_batch]
        rows = [(list(batch.prompts[batch.outputs[i].prompt_index].prompt_ids),
                 list(batch.outputs[i].token_ids)) for i in idx]
        logp, mask = token_logprobs(policy, rows, temperature)
        adv = batch.advantages[idx].to(logp.device)[:, None]
        loss = -(adv * logp * mask).sum() / total_tokens
        loss.backward()
        loss_sum += float(loss.detach())
        engine_lp = torch.cat([torch.tensor(batch.outputs[i].logprobs) for i in idx]).to(logp.device)
        gap_sum += float((logp[mask].detach() - engine_lp).abs().sum())
    grad_norm = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)) if keep else 0.0
    if keep:
        opt.step()
    metrics = {"actor/pg_loss": loss_sum, "actor/grad_norm": grad_norm,
               "actor/samples_with_signal": float(len(keep))}
    if keep:  # the gap is measured on the trained samples only: none, no figure (not a zero)
        metrics["actor/logprob_gap"] = gap_sum / total_tokens
    return metrics


def train_step(step: int, args: argparse.Namespace, engine: Any, base: Optional[Any],
               policy: torch.nn.Module, opt: torch.optim.Optimizer, workload: Workload,
               reward_fn: RewardFn) -> dict[str, float]:
    """Rollouts (timed with and without speculation), the GRPO update, the weight sync."""
    prompts = workload.batch(step)
    params = SamplingParams(n=args.n, temperature=args.temperature,
                            max_new_tokens=args.max_new_tokens, seed=args.seed + step)
    base_out, base_s = None, None

    def base_pass() -> None:
        nonlocal base_out, base_s
        if base is not None:
            start = time.perf_counter()
            base_out = base.generate([list(p.prompt_ids) for p in prompts], params)
            base_s = time.perf_counter() - start

    # alternate which pass goes first, so the first call's warm-up and warm caches favour neither
    if step % 2 == 0:
        base_pass()
    batch = rollout(engine, prompts, params, reward_fn)
    if step % 2 == 1:
        base_pass()
    request_steps = sum(o.num_verify_steps for o in batch.outputs)
    stats = stats_from_outputs(
        step, batch.outputs, batch.seconds, draft_budget=args.draft_tokens, base_outputs=base_out,
        base_seconds=base_s, rewards=batch.rewards.tolist(),
        drafter={"us_per_request": engine.drafter.take_seconds() * 1e6 / max(request_steps, 1)},
        depths=engine.drafter.take_depths())
    engine.end_step()
    start = time.perf_counter()
    policy.train()
    metrics = grpo_update(policy, opt, batch, args.temperature, args.micro_batch)
    sync_weights(engine, policy)
    metrics["timing_s/update"] = time.perf_counter() - start
    metrics.update(wandb_metrics(stats))
    return metrics


def train(args: argparse.Namespace, reward_fn: Optional[RewardFn] = None,
          loaded: Optional[tuple] = None) -> list[dict[str, float]]:
    """Run ``args.steps`` GRPO steps; returns each step's metrics (also printed and logged)."""
    from rich.console import Console

    torch.manual_seed(args.seed)
    engine, base, policy = loaded or load(args)
    sync_weights(engine, policy)  # one source of truth from the start (engine may load differently)
    workload = Workload(args.task, engine.tokenizer, args.prompts, seed=args.seed)
    reward_fn = reward_fn or task_reward(workload, args.format_bonus)
    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    sink = make_sink(resolve_wandb_mode(args.wandb), "rollout-spec-grpo", vars(args))
    console, history = Console(), []
    for step in range(args.steps):
        m = train_step(step, args, engine, base, policy, opt, workload, reward_fn)
        sink.log(m, step=step)
        history.append(m)
        speed, gap, accept = m.get("spec/speedup"), m.get("actor/logprob_gap"), m.get("spec/accept_rate")
        console.print(  # '-' for a figure not measured: no baseline, no gap, nothing drafted
            f"step {step}: reward {m['critic/score/mean']:.3f}  "
            f"accept {'-' if accept is None else f'{accept:.1%}'}  "
            f"TPF {m['spec/tpf']:.2f}  speedup {'-' if speed is None else f'{speed:.2f}x'}  "
            f"loss {m['actor/pg_loss']:+.4f}  grad {m['actor/grad_norm']:.3f}  "
            f"logprob gap {'-' if gap is None else f'{gap:.2e}'}")
    sink.finish()
    return history


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point: parse options and train; a model that cannot be loaded exits with status 1
    and its reason, and --max-new-tokens past the model's context with status 2, as
    ``rollout-spec bench`` does."""
    from rollout_spec.cli import ContextTooShort, ModelNotLoaded

    args = parse_args(argv)
    try:
        train(args)
    except ContextTooShort as exc:
        print(f"grpo_tiny.py: error: {exc}", file=sys.stderr)
        return 2
    except ModelNotLoaded as exc:
        print(f"grpo_tiny.py: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""One-step CPU smoke run of examples/grpo_tiny.py: outputs produced, weights changed and synced."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from test_cli_tiny_model import tiny_model_dir  # noqa: E402  (tests/ is on sys.path under pytest)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "grpo_tiny.py"


def _example():
    spec = importlib.util.spec_from_file_location("grpo_tiny", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["grpo_tiny"] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def test_group_advantages_are_normalised_per_group():
    grpo = _example()
    adv = grpo.group_advantages(torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0, 2.0]), n=3)
    assert adv[:3].sum().abs() < 1e-5 and adv[0] > 0 > adv[1]
    assert torch.allclose(adv[3:], torch.zeros(3))  # no signal when a group agrees


def test_one_grpo_step_changes_and_syncs_weights(tmp_path_factory):
    grpo = _example()
    model = tiny_model_dir(tmp_path_factory.getbasetemp())
    args = grpo.parse_args(["--model", str(model), "--device", "cpu", "--steps", "1", "--prompts", "2",
                            "--n", "2", "--max-new-tokens", "16", "--lr", "1e-2", "--wandb", "disabled"])
    loaded = grpo.load(args)
    engine, _, policy = loaded
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    seen = []

    def reward(prompt, text, ids):  # random weights never answer right: reward token parity instead
        seen.append(list(ids))
        return float(sum(t % 2 for t in ids)) / len(ids)

    history = grpo.train(args, reward_fn=reward, loaded=loaded)
    assert len(history) == 1 and len(seen) == 4 and all(seen)
    m = history[0]
    assert m["actor/samples_with_signal"] > 0 and m["actor/grad_norm"] > 0
    assert m["actor/logprob_gap"] < 1e-3  # the engine sampled from the policy's own weights
    assert m["spec/tpf"] >= 1.0 and "spec/speedup" in m
    after = engine.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the engine has new weights
    assert torch.equal(after["layers.0.mlp.up_proj.weight"],
                       policy.state_dict()["model.layers.0.mlp.up_proj.weight"])

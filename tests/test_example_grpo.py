"""One-step CPU smoke run of examples/grpo_tiny.py: outputs produced, weights changed and synced."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from argument_errors import argument_error, hide_cuda
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
    (flat,) = grpo.train(args, reward_fn=lambda prompt, text, ids: 1.0, loaded=loaded)
    assert flat["actor/samples_with_signal"] == 0 and "actor/logprob_gap" not in flat  # not a zero


def test_the_timed_passes_alternate_which_goes_first(tmp_path_factory):
    """The plain pass always went first, so it alone paid the first call's warm-up."""
    grpo = _example()
    model = tiny_model_dir(tmp_path_factory.getbasetemp())
    args = grpo.parse_args(["--model", str(model), "--device", "cpu", "--steps", "2", "--prompts", "1",
                            "--n", "2", "--max-new-tokens", "4", "--wandb", "disabled"])
    loaded = grpo.load(args)
    engine, base, _ = loaded
    order = []
    for name, e in (("spec", engine), ("base", base)):
        def generate(*a, _inner=e.generate, _name=name, **kw):
            order.append(_name)
            return _inner(*a, **kw)
        e.generate = generate
    grpo.train(args, reward_fn=lambda prompt, text, ids: 1.0, loaded=loaded)
    assert order == ["base", "spec", "spec", "base"]


BAD_OPTIONS = [
    (["--micro-batch", "-1"], "--micro-batch must be in [1,"),
    (["--micro-batch", "0"], "--micro-batch must be in [1,"),
    (["--n", "0"], "--n must be in [2,"),
    (["--n", "1"], "--n must be in [2,"),
    (["--prompts", "0"], "--prompts must be in [1,"),
    (["--steps", "0"], "--steps must be in [1,"),
    (["--steps", "-1"], "--steps must be in [1,"),
    (["--max-batch", "0"], "--max-batch must be in [1,"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be in [1,"),
    (["--temperature", "-1"], "--temperature must be in [0.01, 100.0], got -1.0"),
    (["--temperature", "0"], "--temperature must be in [0.01, 100.0], got 0.0"),
    (["--draft-tokens", "-1"], "--draft-tokens must be in [1,"),
    (["--lr", "0"], "--lr must be in (0.0,"),
    (["--lr", "nan"], "--lr must be in (0.0,"),
    (["--format-bonus", "-1"], "--format-bonus must be in [0.0,"),
    (["--seed", "-1"], "--seed must be in [0,"),
    (["--device", "foo"], "device must be auto, cpu, mps, cuda or cuda:N"),
    (["--task", "nosuch"], "task must be a reasoning-gym task"),
    (["--model", "/no/such/model"], "argument --model: model must be one of ['smollm2-135m'], a .gguf file"),
]


@pytest.mark.parametrize("argv,message", BAD_OPTIONS)
def test_bad_options_are_argument_errors(argv, message, capsys):
    grpo = _example()
    assert message in argument_error(grpo.parse_args, argv, capsys)


def test_missing_reasoning_gym_is_an_argument_error_naming_the_extra(monkeypatch, capsys):
    """Without the [workloads] extra the README's smoke command died in a ModuleNotFoundError
    traceback while argparse converted --task's default."""
    grpo = _example()
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # an import of it now fails
    monkeypatch.setitem(sys.modules, "reasoning_gym.factory", None)
    err = argument_error(grpo.parse_args, ["--device", "cpu", "--steps", "1"], capsys)
    assert "--task: task 'basic_arithmetic'" in err and "pip install 'rollout-spec[workloads]'" in err


def test_cuda_without_a_gpu_is_an_argument_error(monkeypatch, capsys):
    grpo = _example()
    hide_cuda(monkeypatch)
    err = argument_error(grpo.main, ["--device", "cuda", "--steps", "1"], capsys)
    assert "--device cuda: no CUDA device" in err


def test_wandb_mode_is_checked_up_front(monkeypatch, capsys):
    grpo = _example()

    def no_wandb(mode):
        raise ValueError("no wandb")

    monkeypatch.setattr(grpo, "resolve_wandb_mode", no_wandb)
    assert "--wandb: no wandb" in argument_error(grpo.parse_args, ["--wandb", "online"], capsys)


def test_new_tokens_past_the_models_context_exit_before_it_loads(tmp_path_factory, monkeypatch, capsys):
    """512 positions in the tiny model: samples of 600 new tokens were silently cut at its end."""
    from rollout_spec.engine import RolloutEngine

    grpo = _example()
    model = tiny_model_dir(tmp_path_factory.getbasetemp())

    def refuse(*_args, **_kw):
        raise AssertionError("the model was loaded before the error")

    monkeypatch.setattr(RolloutEngine, "from_pretrained", refuse)
    argv = ["--model", str(model), "--device", "cpu", "--steps", "1", "--prompts", "1", "--n", "2",
            "--max-new-tokens", "600", "--wandb", "disabled"]
    assert grpo.main(argv) == 2
    last = capsys.readouterr().err.splitlines()[-1]  # after the tiny model's build progress
    assert last.startswith("grpo_tiny.py: error: --max-new-tokens must be at most") and "got 600" in last, last


def test_good_options_parse(tmp_path):
    grpo = _example()
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")  # a checkpoint folder, as --model checks
    args = grpo.parse_args(["--model", str(tmp_path), "--device", "cpu", "--micro-batch", "1", "--n", "2"])
    assert args.micro_batch == 1 and args.n == 2 and args.device == "cpu" and args.lr == 1e-6

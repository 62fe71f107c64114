"""Malformed input files and refused options at the command-line entry points: each is an
argument error naming the flag (exit status 2, no traceback), raised before any model loads."""
from __future__ import annotations

import gzip
import importlib.util
import sys
from pathlib import Path

import pytest

from argument_errors import argument_error
from rollout_spec import cli

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "grpo_tiny.py"
DEEP = "[" * 100_000 + "]" * 100_000
"""Valid JSON nested deeper than Python's recursion limit: ``json`` raises RecursionError on it."""


def _deep_files(tmp_path: Path) -> list[Path]:
    plain, packed = tmp_path / "deep.json", tmp_path / "deep.json.gz"
    plain.write_text(DEEP)
    packed.write_bytes(gzip.compress(DEEP.encode()))
    return [plain, packed]


def test_load_trace_refuses_deeply_nested_json_as_a_value_error(tmp_path):
    """load_trace promises ValueError for a file that is not a JSON trace; a RecursionError
    escaped it, so every caller's (OSError, ValueError) handler missed it."""
    from rollout_spec.replay import load_trace

    for path in _deep_files(tmp_path):
        with pytest.raises(ValueError, match="not a (gzip )?JSON trace"):
            load_trace(path)


def test_replay_of_a_deeply_nested_trace_is_an_argument_error(tmp_path, capsys):
    for path in _deep_files(tmp_path):
        err = argument_error(cli.main, ["replay", str(path)], capsys)
        assert f"TRACE.json {path}: not a" in err and "JSON trace" in err


@pytest.mark.parametrize("script", ["drafter_bench", "drained_call"])
def test_bench_scripts_refuse_a_deeply_nested_trace(script, tmp_path, capsys):
    module = __import__(script)
    path = _deep_files(tmp_path)[0]
    err = argument_error(module.main, ["--trace", str(path)], capsys)
    assert f"--trace {path}: not a JSON trace" in err


def test_cost_model_from_deeply_nested_json_is_a_value_error(tmp_path, capsys):
    """CostModel.from_json promises ValueError on a malformed file: drained_call's --cost-grid
    reports it as an argument error, and the engine's cost cache measures again."""
    from rollout_spec.engine.budget import CostModel, cached_cost_model

    with pytest.raises(ValueError, match="not a cost model"):
        CostModel.from_json(DEEP)
    (tmp_path / "cost_k.json").write_text(DEEP)
    fresh = CostModel((1,), (1,), ((1e-3,),))
    assert cached_cost_model(tmp_path, "k", lambda: fresh) == fresh
    assert CostModel.from_json((tmp_path / "cost_k.json").read_text()) == fresh  # replaced

    import drained_call

    grid = tmp_path / "grid.json"
    grid.write_text(DEEP)
    trace = tmp_path / "t.json"
    trace.write_text('{"prompts": [{"group_id": 0, "prompt_ids": [1, 2]}], '
                     '"steps": [[{"group_id": 0, "response_ids": [3, 4]}]]}')
    err = argument_error(drained_call.main, ["--trace", str(trace), "--cost-grid", str(grid)], capsys)
    assert f"--cost-grid {grid}: not a cost model" in err


def test_grpo_tiny_refuses_more_humaneval_prompts_than_there_are(capsys):
    """The example ran the model load and then died in Workload with a ValueError traceback."""
    from rollout_spec.workloads import humaneval_size

    spec = importlib.util.spec_from_file_location("grpo_tiny", EXAMPLE)
    grpo = importlib.util.module_from_spec(spec)
    sys.modules["grpo_tiny"] = grpo  # dataclasses look their module up while the file runs
    spec.loader.exec_module(grpo)
    available = humaneval_size()
    err = argument_error(grpo.parse_args, ["--device", "cpu", "--task", "humaneval",
                                           "--prompts", str(available + 1)], capsys)
    assert f"--prompts must be <= {available} for humaneval, got {available + 1}" in err


@pytest.mark.parametrize("argv,message", [
    (["--task", "composite"], "--task composite with --seed 0: reasoning-gym cannot make 4 prompts"),
    (["--task", "pool_matrix", "--seed", str(2**32)],
     f"--task pool_matrix with --seed {2**32}: reasoning-gym cannot make 4 prompts (ValueError"),
    (["--task", "pool_matrix", "--seed", str(2**32 - 2), "--steps", "2", "--fresh-prompts"],
     "reasoning-gym cannot make 8 prompts"),  # seed + index of the last prompt passes 2**32 - 1
])
def test_bench_refuses_a_task_that_cannot_make_its_prompts(argv, message, capsys, monkeypatch):
    """task_arg accepts every registered reasoning-gym name, but composite needs a config and
    pool_matrix seeds numpy with seed + index (below 2**32): the run loaded the model, then died in
    Workload with a traceback."""
    def no_model(args):
        raise AssertionError("the model was loaded before the task was checked")

    monkeypatch.setattr(cli, "open_engines", no_model)
    assert message in argument_error(cli.main, ["bench", "--device", "cpu", "--wandb", "disabled", *argv], capsys)


def test_grpo_tiny_refuses_a_task_that_cannot_make_its_prompts(capsys):
    spec = importlib.util.spec_from_file_location("grpo_tiny", EXAMPLE)
    grpo = importlib.util.module_from_spec(spec)
    sys.modules["grpo_tiny"] = grpo
    spec.loader.exec_module(grpo)
    err = argument_error(grpo.parse_args, ["--device", "cpu", "--task", "composite"], capsys)
    assert "--task composite with --seed 0: reasoning-gym cannot make 8 prompts" in err


def test_bench_wandb_error_names_the_flag(capsys, monkeypatch):
    monkeypatch.setattr("rollout_spec.metrics.wandb_available", lambda: False)
    err = argument_error(cli.main, ["bench", "--wandb", "offline"], capsys)
    assert "error: --wandb: wandb mode 'offline' needs the wandb package" in err


def test_grpo_tiny_reports_an_unloadable_model_without_a_traceback(tmp_path, capsys):
    """A --model folder that passes the up-front check but does not load (config.json without a
    model_type) ended the example in transformers' ValueError traceback; rollout-spec bench reports
    the same folder as 'cannot load --model' with exit status 1."""
    spec = importlib.util.spec_from_file_location("grpo_tiny", EXAMPLE)
    grpo = importlib.util.module_from_spec(spec)
    sys.modules["grpo_tiny"] = grpo
    spec.loader.exec_module(grpo)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    argv = ["--model", str(tmp_path), "--device", "cpu", "--steps", "1", "--prompts", "1", "--n", "2",
            "--max-new-tokens", "2", "--wandb", "disabled"]
    assert grpo.main(argv) == 1
    err = capsys.readouterr().err
    assert f"grpo_tiny.py: error: cannot load --model {tmp_path}:" in err and "Traceback" not in err


def test_bench_reports_a_truncated_gguf_without_a_traceback(tmp_path, capsys, monkeypatch):
    """A .gguf cut short (an interrupted download) made transformers' GGUF reader raise
    struct.error, which ended the bench in a traceback; it is 'cannot load --model', status 1,
    found by the header check before any conversion."""
    monkeypatch.setenv("ROLLOUT_SPEC_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "cut.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00")  # the magic and version, then nothing
    argv = ["bench", "--model", str(gguf), "--device", "cpu", "--task", "basic_arithmetic",
            "--wandb", "disabled"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert f"rollout-spec bench: error: cannot load --model {gguf}: {gguf} is not a GGUF file transformers can read" in err

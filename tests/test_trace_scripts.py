"""Flag errors of the trace generators (``synthetic_trace.py``, ``edit_trace.py``) and of the
scripts that replay traces (``draft_size_yield.py``, ``shared_index_bench.py``): each is an
argparse error (exit 2) naming the flag, raised before any work starts."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from argument_errors import argument_error  # noqa: E402
import draft_size_yield  # noqa: E402
import edit_trace  # noqa: E402
import synthetic_trace  # noqa: E402
from markdown_table import table_rows  # noqa: E402
from rollout_spec.replay import Trace, load_trace, save_trace  # noqa: E402
from synthetic_trace import SyntheticSpec, make_synthetic_trace  # noqa: E402


def small_trace(path: Path, steps: int = 2) -> Path:
    """A few-request synthetic trace written to ``path``."""
    save_trace(make_synthetic_trace(SyntheticSpec(prompts=2, n=4, steps=steps, max_tokens=120, seed=1)), path)
    return path


def test_the_generators_write_a_trace_that_loads(tmp_path, capsys) -> None:
    synthetic_trace.main([str(tmp_path / "s.json.gz"), "--prompts", "2", "--n", "3", "--steps", "2"])
    edit_trace.main([str(tmp_path / "e.json"), "--prompts", "2", "--file-tokens", "50"])
    assert [len(s) for s in load_trace(tmp_path / "s.json.gz").steps] == [6, 6]
    assert [len(s) for s in load_trace(tmp_path / "e.json").steps] == [2]


@pytest.mark.parametrize("argv, message", [
    (["--prompts", "0"], "argument --prompts: --prompts must be in [1, 100000], got 0"),
    (["--n", "-1"], "argument --n: --n must be in [1, 1024], got -1"),
    (["--steps", "0"], "argument --steps: --steps must be in [1, 1000], got 0"),
    (["--seed", "-1"], "argument --seed: --seed must be in [0, inf], got -1"),
])
def test_synthetic_trace_refuses_counts_that_would_write_an_empty_trace(tmp_path, argv, message, capsys) -> None:
    assert message in argument_error(synthetic_trace.main, [str(tmp_path / "t.json.gz")] + argv, capsys)
    assert not (tmp_path / "t.json.gz").exists()


@pytest.mark.parametrize("argv, message", [
    (["--prompts", "0"], "argument --prompts: --prompts must be in [1, 100000], got 0"),
    (["--file-tokens", "x"], "argument --file-tokens: --file-tokens must be an integer in [1, 1048576], got 'x'"),
    (["--seed", "-1"], "argument --seed: --seed must be in [0, inf], got -1"),
])
def test_edit_trace_bad_flags(tmp_path, argv, message, capsys) -> None:
    assert message in argument_error(edit_trace.main, [str(tmp_path / "t.json.gz")] + argv, capsys)


@pytest.mark.parametrize("script, maker", [(synthetic_trace, "make_synthetic_trace"),
                                           (edit_trace, "make_edit_trace")])
def test_an_output_in_a_missing_folder_is_refused_before_generating(script, maker, monkeypatch, capsys) -> None:
    monkeypatch.setattr(script, maker, lambda *a: pytest.fail("generated a trace it could not write"))
    err = argument_error(script.main, ["/nonexistent/x.json.gz"], capsys)
    assert "out /nonexistent/x.json.gz: folder /nonexistent does not exist" in err


def test_draft_size_yield_defaults_to_the_steps_a_one_step_trace_has(tmp_path, capsys) -> None:
    draft_size_yield.main(["--trace", str(small_trace(tmp_path / "t.json.gz", steps=1)), "--max-live", "8"])
    assert len(table_rows(capsys.readouterr().out)) == 3


@pytest.mark.parametrize("argv, message", [
    (["--steps", "50"], "--steps 50: trace {trace} has only 2 steps"),  # replayed 2 steps silently
    (["--max-live", "0"], "argument --max-live: --max-live must be in [1, 1048576], got 0"),
    (["--max-live", "100000000000000000000"], "argument --max-live: --max-live must be in [1, 1048576], got 100000000000000000000"),
    (["--steps", "-1"], "argument --steps: --steps must be in [1, inf], got -1"),
])
def test_draft_size_yield_bad_flags(tmp_path, argv, message, capsys) -> None:
    trace = small_trace(tmp_path / "t.json.gz")
    err = argument_error(draft_size_yield.main, ["--trace", str(trace)] + argv, capsys)
    assert message.format(trace=trace) in err


def test_draft_size_yield_names_a_trace_that_does_not_load(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.json.gz"
    bad.write_text("not gzip")  # was a raw ValueError traceback
    err = argument_error(draft_size_yield.main, ["--trace", str(bad)], capsys)
    assert f"--trace {bad}: not a gzip JSON trace" in err


def test_draft_size_yield_refuses_a_trace_without_responses(tmp_path, capsys) -> None:
    path = tmp_path / "empty.json.gz"
    save_trace(Trace(prompts={0: [1, 2, 3]}, steps=[], meta={}), path)
    err = argument_error(draft_size_yield.main, ["--trace", str(path)], capsys)
    assert f"--trace {path}: every step must hold responses" in err


@pytest.mark.parametrize("argv, message", [
    (["--replicas", "0"], "argument --replicas: --replicas must be in [1, 65536], got 0"),
    (["--requests", "-8"], "argument --requests: --requests must be in [1, 1048576], got -8"),
    (["--requests", "100000000000000000000"], "argument --requests: --requests must be in [1, 1048576], got 100000000000000000000"),
    (["--n", "0"], "argument --n: --n must be in [1, 1024], got 0"),
    (["--n", "100000000000000000000"], "argument --n: --n must be in [1, 1024], got 100000000000000000000"),
    (["--steps", "0"], "argument --steps: --steps must be in [1, 100000], got 0"),
    (["--steps", "100000000000000000000"], "argument --steps: --steps must be in [1, 100000], got 100000000000000000000"),
    (["--hosts", "0"], "argument --hosts: --hosts must be in [1, 65536], got 0"),
    (["--hosts", "100000000000000000000"], "argument --hosts: --hosts must be in [1, 65536], got 100000000000000000000"),
    (["--affinity-k", "0"], "argument --affinity-k: --affinity-k must be in [1, 65536], got 0"),
    (["--shards", "0"], "argument --shards: --shards must be in [1, 4096], got 0"),
    (["--retain-steps", "0"], "argument --retain-steps: --retain-steps must be in [1, 1048576], got 0"),
    (["--requests", "12", "--n", "8"], "--requests 12 must be a multiple of --n 8"),
    (["--replicas", "2", "--hosts", "3"], "--hosts 3 must be at most --replicas 2"),
    (["--trace", "/nonexistent/t.json.gz"], "--trace /nonexistent/t.json.gz: trace file not found"),
    (["--n", "8", "--requests", "64", "--trace", "{trace}"], "--n 8: the groups of trace {trace} hold as few as 4"),
])
def test_shared_index_bench_bad_flags_exit_before_ray_starts(tmp_path, argv, message, monkeypatch, capsys) -> None:
    ray = pytest.importorskip("ray")
    import shared_index_bench

    trace = str(small_trace(tmp_path / "t.json.gz"))  # groups of 4 responses
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("ray.init ran before the flags were checked"))
    argv = [a.format(trace=trace) for a in argv]
    assert message.format(trace=trace) in argument_error(shared_index_bench.main, argv, capsys)


@pytest.mark.parametrize("field, value, message", [
    ("prompts", 0, "prompts must be in [1, 100000], got 0"),  # wrote a trace of empty steps
    ("n", 0, "n must be in [1, 1024], got 0"),
    ("steps", 0, "steps must be in [1, 1000], got 0"),
    ("vocab", 3, "vocab must be in [4, 2147483648], got 3"),  # numpy's "low >= high"
    ("phrases", 0, "phrases must be in [1, 1048576], got 0"),
    ("max_tokens", 1, "max_tokens must be in [2, 1048576], got 1"),
    ("eos", -5, "eos must be in [0, 2147483647], got -5"),  # a trace load_trace refuses
    ("follow", 1.5, "follow must be in [0.0, 1.0], got 1.5"),
    ("drift", -1.0, "drift must be in [0.0, 1.0], got -1.0"),
    ("seed", -1, "seed must be in [0, inf], got -1"),
])
def test_synthetic_spec_refuses_a_bad_field_naming_it(field, value, message) -> None:
    with pytest.raises(ValueError) as exc:
        SyntheticSpec(**{field: value})
    assert message in str(exc.value)


@pytest.mark.parametrize("max_tokens", [2, 50, 100])
def test_synthetic_traces_of_short_responses_are_made_and_load(tmp_path, max_tokens) -> None:
    """Up to 100 tokens raised numpy's "low >= high" (a solution was drawn at least 100 long)."""
    trace = make_synthetic_trace(SyntheticSpec(prompts=2, n=2, steps=1, max_tokens=max_tokens, seed=1))
    assert all(1 <= len(r) <= max_tokens for _, r in trace.steps[0])
    save_trace(trace, tmp_path / "t.json.gz")
    assert load_trace(tmp_path / "t.json.gz").steps == trace.steps


@pytest.mark.parametrize("field, value, message", [
    ("prompts", 0, "prompts must be in [1, 100000], got 0"),
    ("file_tokens", 0, "file_tokens must be in [1, 1048576], got 0"),
    ("instruction_tokens", -1, "instruction_tokens must be in [0, 1048576], got -1"),
    ("vocab", 0, "vocab must be in [1, 2147483648], got 0"),
    ("zipf", -1, "zipf must be in [0.0, 100.0], got -1.0"),
    ("edit_rate", 2.0, "edit_rate must be in [0.0, 1.0], got 2.0"),
    ("max_edit", 0, "max_edit must be in [1, 1048576], got 0"),
    ("seed", -1, "seed must be in [0, inf], got -1"),
])
def test_edit_spec_refuses_a_bad_field_naming_it(field, value, message) -> None:
    from edit_trace import EditSpec

    with pytest.raises(ValueError) as exc:
        EditSpec(**{field: value})
    assert message in str(exc.value)

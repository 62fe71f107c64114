"""``bench/verify_bench.py``'s flag errors: every option is typed and range-checked at parse time,
before any model is built, and a short CPU run of the grid."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from argument_errors import argument_error, hide_cuda  # noqa: E402
import verify_bench as vb  # noqa: E402
from rollout_spec.engine import triton_attention  # noqa: E402


@pytest.mark.parametrize("argv, message", [
    (["--batch-sizes", "0"], "every --batch-sizes value must be in [1, 1024], got 0"),
    (["--batch-sizes", "abc"], "--batch-sizes must be comma-separated integers, got 'abc'"),
    (["--budgets", "-1"], "every --budgets value must be in [1, 256], got -1"),
    (["--modes", "foo"], "every --modes value must be one of t1.0, greedy, t0.7_k50_p0.9; got 'foo'"),
    (["--backends", "foo"], "every --backends value must be one of torch, auto, triton; got 'foo'"),
    (["--reps", "-1"], "argument --reps: --reps must be in [1, 100000], got -1"),
    (["--reps", "0"], "argument --reps: --reps must be in [1, 100000], got 0"),
    (["--step-ms", "0"], "argument --step-ms: --step-ms must be in (0.0, 1000000.0], got 0.0"),
    (["--context", "-1"], "argument --context: --context must be in [1, 8190], got -1"),
    (["--context", "8000", "--budgets", "256"], "--context 8000 + the largest --budgets value 256 + 1 exceeds"),
    (["--device", "foo"], "argument --device: device must be auto, cpu, mps, cuda or cuda:N, got 'foo'"),
    # a repeated value timed its rows twice
    (["--budgets", "4,8,4"], "argument --budgets: --budgets lists 4 more than once"),
    (["--modes", "greedy,greedy"], "argument --modes: --modes lists greedy more than once"),
])
def test_bad_flags_exit_naming_the_flag(argv, message, monkeypatch, capsys) -> None:
    monkeypatch.setattr(vb, "make_model", lambda *_: pytest.fail("model built before the error"))
    assert message in argument_error(vb.main, ["--device", "cpu"] + argv, capsys)


def test_triton_backend_without_triton_exits(monkeypatch, capsys) -> None:
    monkeypatch.setattr(triton_attention, "is_available", lambda: False)
    err = argument_error(vb.main, ["--device", "cpu", "--backends", "torch,triton"], capsys)
    assert "--backends triton: the triton package is not installed" in err


def test_triton_backend_off_cuda_exits_unless_interpreted(monkeypatch, capsys) -> None:
    """Triton's kernels need a CUDA device: on the CPU the first triton row died in a traceback
    from triton's driver ("0 active drivers"). TRITON_INTERPRET=1 runs them there."""
    monkeypatch.setattr(triton_attention, "is_available", lambda: True)
    monkeypatch.setattr(vb, "make_model", lambda *_: pytest.fail("model built before the error"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    err = argument_error(vb.main, ["--device", "cpu", "--backends", "torch,triton"], capsys)
    assert "--backends triton: the Triton kernels run on CUDA, not on --device cpu" in err
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert vb.parse_args(["--device", "cpu", "--backends", "triton"]).backends == ["triton"]


def test_cuda_without_a_gpu_exits(monkeypatch, capsys) -> None:
    hide_cuda(monkeypatch)
    err = argument_error(vb.main, ["--device", "cuda"], capsys)
    assert "--device cuda: no CUDA device is visible here" in err


def test_cpu_defaults_and_a_tiny_grid(capsys) -> None:
    args = vb.parse_args(["--device", "cpu"])
    assert (args.batch_sizes, args.budgets, args.backends, args.reps) == ([1, 64], [4, 8], ["torch"], 3)
    vb.main(["--device", "cpu", "--batch-sizes", "2", "--budgets", "3", "--modes", "greedy", "--reps", "1",
             "--no-forward"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("   2 ")]
    assert [r[:5] for r in rows] == [["2", "3", "4", "greedy", "torch"]]
    assert rows[0][8:10] == ["-", "-"]  # no forward was timed: its two cells say so, not nan


def test_device_defaults_to_auto(monkeypatch) -> None:
    hide_cuda(monkeypatch)
    assert vb.parse_args([]).device == "cpu"


def test_profile_defaults_to_one_point_of_ten_calls() -> None:
    args = vb.parse_args(["--device", "cpu", "--profile"])
    assert (args.batch_sizes, args.budgets, args.reps) == ([64], [8], 10)


def test_step_ms_with_profile_exits_naming_both(monkeypatch, capsys) -> None:
    """--profile prints no /step ratio: a given --step-ms was silently ignored there; it is refused.
    Without --profile it keeps its default of 4.5 ms."""
    monkeypatch.setattr(vb, "profile", lambda *_: pytest.fail("profiled before the error"))
    err = argument_error(vb.main, ["--device", "cpu", "--profile", "--step-ms", "3"], capsys)
    assert "--step-ms 3: --profile prints profiler tables, with no /step ratio" in err
    assert vb.parse_args(["--device", "cpu"]).step_ms == 4.5
    assert vb.parse_args(["--device", "cpu", "--step-ms", "3"]).step_ms == 3.0


def test_profile_runs_at_every_requested_point(monkeypatch, capsys) -> None:
    """--profile honours the grid flags: one set of tables per (B, budget), the given calls each,
    trees at --context and --deep logits."""
    seen: set[tuple] = set()
    build, logits = vb.build_tree_inputs, vb.step_logits

    def spy_build(batch, roots, positions, device):
        seen.add(("positions", int(positions[0])))
        return build(batch, roots, positions, device)

    def spy_logits(batch, device, deep):
        seen.add(("deep", deep))
        return logits(batch, device, deep)

    monkeypatch.setattr(vb, "make_model", lambda *_: pytest.fail("--profile runs no forward"))
    monkeypatch.setattr(vb, "build_tree_inputs", spy_build)
    monkeypatch.setattr(vb, "step_logits", spy_logits)
    vb.main(["--device", "cpu", "--profile", "--batch-sizes", "2,3", "--budgets", "5", "--modes", "greedy",
             "--reps", "2", "--context", "100", "--deep"])
    titles = [line for line in capsys.readouterr().out.splitlines() if line.startswith("== ")]
    assert titles == [f"== B={b}, budget 5: {job} (2 calls)" for b in (2, 3)
                      for job in ("build", "build numpy roots", "verify greedy torch")]
    assert seen == {("positions", 100), ("deep", True)}

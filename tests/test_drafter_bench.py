"""CPU smoke runs of ``bench/drafter_bench.py``: its table, the median of repeated replays, and its
flag errors."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from argument_errors import argument_error  # noqa: E402
from bench_traces import small_trace  # noqa: E402
import drafter_bench  # noqa: E402
from rollout_spec.replay import StepResult, Trace, save_trace  # noqa: E402
from markdown_table import table_rows  # noqa: E402


def test_repeated_replays_print_the_median_run_and_the_range(tmp_path, capsys) -> None:
    drafter_bench.main(["--trace", str(small_trace(tmp_path)), "--drafters", "ours,prompt-lookup",
                        "--max-live", "8", "--repeat", "3"])
    out = capsys.readouterr().out
    assert "median of 3 runs" in out
    rows = table_rows(out)
    assert [(r[0], r[1]) for r in rows] == [("0", "ours"), ("0", "prompt-lookup"), ("1", "ours"), ("1", "prompt-lookup")]
    for r in rows:
        cost = float(r[5])
        low, high = (float(x) for x in r[7].split("-"))
        assert low <= cost <= high
        propose, extend = (float(x) for x in r[6].split("+"))
        assert propose + extend == pytest.approx(cost, abs=0.011)
    assert float(rows[0][2]) > 1.0  # ours drafts accepted tokens on a trace whose siblings share spans


def test_a_single_run_has_no_range_column(tmp_path, capsys) -> None:
    drafter_bench.main(["--trace", str(small_trace(tmp_path)), "--drafters", "ours", "--max-live", "8"])
    out = capsys.readouterr().out
    assert "median" not in out and all(len(r) == 7 for r in table_rows(out))


def test_tables_on_stdout_and_progress_on_stderr(tmp_path, capsys) -> None:
    """``drafter_bench.py > out.md`` keeps the header line (machine, settings, date) and the
    tables; the per-replay progress lines go to stderr."""
    drafter_bench.main(["--trace", str(small_trace(tmp_path)), "--drafters", "ours", "--max-live", "8"])
    out, err = capsys.readouterr()
    assert out.startswith("# drafter bench on ") and "## t.json.gz: 4 prompts, 2 steps" in out
    assert [(r[0], r[1]) for r in table_rows(out)] == [("0", "ours"), ("1", "ours")]
    assert "[t.json.gz] ours: replayed in " in err and "replayed in" not in out
    assert "| ours |" not in err


@pytest.mark.parametrize("name, threads", [("ours", 1), ("ours-full", 1), ("ours@4", 4), ("ours@0", 0)])
def test_ours_runs_on_the_threads_its_name_says(name, threads) -> None:
    # The plain name is the one-thread row, timed by CPU time: SpecConfig's default (0, auto)
    # would split its calls over half the machine's hardware threads (8 on a 16-core host).
    assert drafter_bench.make_drafter(name, 8).config.propose_threads == threads


def step(cost_seconds: float, accepted: int = 5) -> StepResult:
    return StepResult(step=1, tokens=30, verify_steps=10, drafted=40, accepted=accepted,
                      request_iterations=10, drafter_seconds=cost_seconds)


def test_median_run_is_the_middle_cost_and_the_upper_middle_of_an_even_count() -> None:
    runs = [step(3e-5), step(1e-5), step(2e-5)]
    assert drafter_bench.median_run("ours", runs) is runs[2]
    assert drafter_bench.median_run("ours", runs + [step(4e-5)]).drafter_seconds == 3e-5


def test_replays_that_drafted_differently_are_an_error() -> None:
    with pytest.raises(RuntimeError, match="ours: step 1 drafted differently in 2 replays"):
        drafter_bench.median_run("ours", [step(1e-5), step(1e-5, accepted=6)])


@pytest.mark.parametrize("argv, message", [
    (["--repeat", "0"], "argument --repeat: --repeat must be in [1, 1000], got 0"),
    (["--drafters", "nope"], "every --drafters value must be one of ours, ours-full, arctic, prompt-lookup; got 'nope'"),
    (["--drafters", ","], "every --drafters value must be one of"),  # an empty list ran no drafter
    (["--drafters", "ours,ours"], "argument --drafters: --drafters lists ours more than once"),
    (["--propose-threads", "2,4,2"], "argument --propose-threads: --propose-threads lists 2 more than once"),
    (["--propose-threads", "two"], "--propose-threads must be comma-separated integers"),
    (["--propose-threads", ","], "--propose-threads must be comma-separated integers"),  # dropped every ours row
    (["--propose-threads", "1,300"], "every --propose-threads value must be in [0, 256], got 300"),
    (["--propose-threads", "4", "--drafters", "prompt-lookup"], "--propose-threads sets the threads of ours"),
    (["--budget", "-1", "--drafters", "prompt-lookup"], "argument --budget: --budget must be in [1, 1024], got -1"),
    (["--max-live", "0"], "argument --max-live: --max-live must be in [1, 1048576], got 0"),  # hung forever
    (["--max-live", "-5"], "argument --max-live: --max-live must be in [1, 1048576], got -5"),
    (["--max-live", "100000000000000000000"], "argument --max-live: --max-live must be in [1, 1048576], got 100000000000000000000"),
])
def test_bad_flags_exit_with_a_message_naming_them(argv, message, capsys) -> None:
    # A missing trace as well: a flag that slipped through would exit on the trace instead (or hang).
    assert message in argument_error(drafter_bench.main, argv + ["--trace", "/nonexistent/t.json.gz"], capsys)


def test_arctic_alone_when_it_is_not_installed_is_an_error(monkeypatch, capsys) -> None:
    monkeypatch.setattr(drafter_bench, "arctic_available", lambda: False)
    err = argument_error(drafter_bench.main, ["--drafters", "arctic"], capsys)
    assert "--drafters arctic: arctic-inference is not installed" in err


def test_arctic_beside_others_when_it_is_not_installed_is_skipped_with_a_note(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(drafter_bench, "arctic_available", lambda: False)
    drafter_bench.main(["--trace", str(small_trace(tmp_path)), "--drafters", "ours,arctic", "--max-live", "8"])
    out, err = capsys.readouterr()
    assert "NOTE: arctic-inference is not installed" in err
    assert {r[1] for r in table_rows(out)} == {"ours"}


def test_a_trace_without_responses_is_an_error(tmp_path, capsys) -> None:
    path = tmp_path / "empty.json.gz"
    save_trace(Trace(prompts={0: [1, 2, 3]}, steps=[[]], meta={}), path)
    err = argument_error(drafter_bench.main, ["--trace", str(path), "--drafters", "ours"], capsys)
    assert f"--trace {path}: every step must hold responses" in err


def test_a_trace_of_empty_responses_is_an_error(tmp_path, capsys) -> None:
    """It replayed to a table of dashes; refused as rollout-spec replay refuses it."""
    path = tmp_path / "empty.json.gz"
    save_trace(Trace(prompts={0: [1, 2, 3]}, steps=[[(0, [])], [(0, [])]], meta={}), path)
    err = argument_error(drafter_bench.main, ["--trace", str(path), "--drafters", "ours"], capsys)
    assert f"--trace {path}: every response is empty (no tokens to replay)" in err


def test_a_step_of_empty_responses_is_named_in_a_note(tmp_path, capsys) -> None:
    path = tmp_path / "partial.json.gz"
    save_trace(Trace(prompts={0: [1, 2, 3]}, steps=[[(0, [4, 5])], [(0, [])]], meta={}), path)
    drafter_bench.main(["--trace", str(path), "--drafters", "ours"])
    out, err = capsys.readouterr()
    assert f"NOTE: {path}: every response of step 1 is empty; no figures for it (shown as -)" in err
    assert [r[2] for r in table_rows(out)] == ["1.000", "-"]


def test_a_trace_that_is_not_json_exits_with_a_message_naming_it(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    err = argument_error(drafter_bench.main, ["--trace", str(bad), "--drafters", "ours"], capsys)
    assert f"--trace {bad}: not a JSON trace" in err

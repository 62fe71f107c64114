"""CPU smoke runs of the budget's bench scripts: ``draft_size_yield.py`` (E(k) three ways on a
trace), ``idle_overhead.py`` (a speculative engine that never drafts), ``budget_overhead.py``
(the budget's bookkeeping per step) and ``drained_call.py`` (the budget's two rules on one
synchronous batch), and their flag errors."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from argument_errors import argument_error, hide_cuda  # noqa: E402
from bench_traces import small_trace  # noqa: E402
import budget_overhead  # noqa: E402
import draft_size_yield  # noqa: E402
import drained_call  # noqa: E402
import engine_bench  # noqa: E402
import idle_overhead  # noqa: E402
from rollout_spec.engine.budget import CostModel, budget_from_cost  # noqa: E402
from rollout_spec.replay import Trace, load_trace, save_trace  # noqa: E402
from markdown_table import table_rows  # noqa: E402
from synthetic_trace import SyntheticSpec, make_synthetic_trace  # noqa: E402


def test_draft_size_yield_prints_three_estimates_per_size(tmp_path, capsys) -> None:
    path = small_trace(tmp_path, seed=3)
    draft_size_yield.main(["--trace", str(path), "--steps", "2", "--max-live", "8"])
    out, err = capsys.readouterr()
    rows = {r[1]: [float(x) for x in r[2:]] for r in table_rows(out)}
    assert set(rows) == {"proposed at k", "prefix of 8-node trees", "per-depth model"}
    assert f"[{path.name}: replayed in " in err  # a status line per trace, on stderr
    prefix = rows["prefix of 8-node trees"]
    assert prefix == sorted(prefix) and prefix[0] > 1.0  # a tree's first k nodes keep more as k grows
    assert rows["proposed at k"][-1] == prefix[-1]  # k = 8: the same replay either way


def test_idle_overhead_runs_three_engines_and_takes_shadow_measurements(monkeypatch, capsys) -> None:
    monkeypatch.setitem(engine_bench.SMOLLM2_135M, "num_hidden_layers", 2)
    idle_overhead.main(["--device", "cpu", "--slots", "4", "--batch-sizes", "1", "--new-tokens", "20",
                        "--rounds", "2"])
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert [r[1] for r in rows] == ["plain", "spec, budget 0", "spec, budget 0 + shadow"]
    assert all(float(r[2].split()[0]) > 0 for r in rows)
    assert int(out.split("shadow measurements taken: ")[1].split()[0]) > 0


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps"),
    (["--trace", "/nonexistent/t.json.gz"], "/nonexistent/t.json.gz"),
])
def test_draft_size_yield_bad_flags(argv, message, capsys) -> None:
    with pytest.raises(SystemExit):
        draft_size_yield.main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--device", "cpu", "--slots", "4", "--batch-sizes", "8"], "every --batch-sizes value must be in [1, --slots=4]"),
    (["--device", "cpu", "--new-tokens", "20000000"], "argument --new-tokens: --new-tokens must be in [2, 8048]"),
    (["--device", "cpu", "--batch-sizes", "abc"],
     "argument --batch-sizes: --batch-sizes must be comma-separated integers"),
    # a comma list, as engine_bench.py, verify_bench.py and budget_overhead.py take it
    (["--device", "cpu", "--slots", "8", "--batch-sizes", "1,64"],
     "every --batch-sizes value must be in [1, --slots=8], got 64"),
    (["--device", "cpu", "--batch-sizes", "1,0"],
     "argument --batch-sizes: every --batch-sizes value must be in [1, 1048576], got 0"),
    (["--device", "cpu", "--rounds", "1"], "argument --rounds: --rounds must be in [2, 1000], got 1"),
    (["--device", "foo"], "argument --device: device must be auto, cpu, mps, cuda or cuda:N"),
    # one new token is the prefill's: no decode step to time (a ZeroDivisionError after the run)
    (["--device", "cpu", "--new-tokens", "1"], "argument --new-tokens: --new-tokens must be in [2, 8048], got 1"),
    (["--device", "cpu", "--batch-sizes", "1,64,1"],
     "argument --batch-sizes: --batch-sizes lists 1 more than once"),  # the same rows twice
])
def test_idle_overhead_bad_flags(argv, message, monkeypatch, capsys) -> None:
    monkeypatch.setattr(idle_overhead, "random_model", lambda *_: pytest.fail("model built before the error"))
    assert message in argument_error(idle_overhead.main, argv, capsys)


def test_idle_overhead_device_defaults_to_auto(monkeypatch, capsys) -> None:
    """Without --device it runs where it can, as the other engine scripts do (it used to default
    to cuda, an error on a machine without one); the slots check after the device is reached."""
    hide_cuda(monkeypatch)
    monkeypatch.setattr(idle_overhead, "random_model", lambda *_: pytest.fail("model built before the error"))
    err = argument_error(idle_overhead.main, ["--slots", "4", "--batch-sizes", "8"], capsys)
    assert "every --batch-sizes value must be in [1, --slots=4], got 8" in err


def test_idle_overhead_cuda_without_a_gpu(monkeypatch, capsys) -> None:
    hide_cuda(monkeypatch)
    err = argument_error(idle_overhead.main, ["--device", "cuda"], capsys)
    assert "--device cuda: no CUDA device is visible here" in err


def test_budget_overhead_prints_a_row_per_batch_size(capsys) -> None:
    budget_overhead.main(["--steps", "50", "--batch-sizes", "8,300"])
    rows = table_rows(capsys.readouterr().out)
    assert [r[0] for r in rows] == ["8", "300"]
    assert all(float(x) > 0 for r in rows for x in r[1:])


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "argument --steps: --steps must be in [1, 1000000000], got 0"),
    (["--batch-sizes", "0,8"], "argument --batch-sizes: every --batch-sizes value must be in [1, 1048576], got 0"),
    (["--batch-sizes", ","], "argument --batch-sizes: --batch-sizes must be comma-separated integers"),
    (["--batch-sizes", "abc"], "argument --batch-sizes: --batch-sizes must be comma-separated integers"),
    (["--batch-sizes", "2000000"], "every --batch-sizes value must be in [1, 1048576], got 2000000"),
    (["--batch-sizes", "8,128,8"], "argument --batch-sizes: --batch-sizes lists 8 more than once"),
])
def test_budget_overhead_bad_flags(argv, message, capsys) -> None:
    assert message in argument_error(budget_overhead.main, argv, capsys)


def test_drained_call_prints_both_rules_per_step(tmp_path, capsys) -> None:
    """Each RL step's row: the plain call's modelled seconds, and each rule's speedup and TPF
    (synthetic siblings share long spans, so a drafting rule gains)."""
    path = small_trace(tmp_path, seed=3)
    drained_call.main(["--trace", str(path), "--batch", "8"])
    rows = table_rows(capsys.readouterr().out)
    assert [r[1] for r in rows] == ["0", "1"]
    plain = [float(r[2]) for r in rows]
    speedups = [float(c.split("x")[0]) for r in rows for c in r[3:]]
    tpfs = [float(c.split("(")[1].rstrip(")")) for r in rows for c in r[3:]]
    assert all(p > 0 for p in plain) and len(speedups) == 4
    assert all(t >= 1.0 for t in tpfs) and max(speedups) > 1.0


def test_drained_call_skips_empty_responses(tmp_path, capsys) -> None:
    """An empty response (load_trace takes it) decodes nothing: no forward, no step, and a call of
    only empty ones costs nothing (it raised: a step of 0 tokens)."""
    trace = make_synthetic_trace(SyntheticSpec(prompts=2, n=2, steps=2, max_tokens=120, seed=1))
    trace.steps[0][1] = (trace.steps[0][1][0], [])
    trace.steps[1] = [(g, []) for g, _ in trace.steps[1]]
    path = tmp_path / "t.json.gz"
    save_trace(trace, path)
    drained_call.main(["--trace", str(path), "--batch", "1"])
    rows = table_rows(capsys.readouterr().out)
    assert [r[1] for r in rows] == ["0", "1"] and float(rows[0][2]) > 0 and float(rows[1][2]) == 0
    assert rows[1][3:] == ["- (nothing decoded)"] * 2 and all("x (" in c for c in rows[0][3:])


def test_drained_call_reads_a_cost_grid(tmp_path, capsys) -> None:
    """``--cost-grid`` replaces the modelled grid: plain seconds follow the file's."""
    trace = tmp_path / "t.json.gz"
    save_trace(make_synthetic_trace(SyntheticSpec(prompts=2, n=4, steps=1, max_tokens=120, seed=1)), trace)
    grid = tmp_path / "cost.json"
    grid.write_text(CostModel((1, 8), (1, 2, 3, 5, 9), ((1.0,) * 5, (1.0,) * 5)).to_json())
    drained_call.main(["--trace", str(trace), "--batch", "8", "--cost-grid", str(grid)])
    rows = table_rows(capsys.readouterr().out)
    longest = max(len(r) for _, r in load_trace(trace).steps[0])
    assert float(rows[0][2]) == pytest.approx(longest * (1.0 + drained_call.HOST_PLAIN_S), rel=1e-3)


@pytest.mark.parametrize("argv, message", [
    (["--batch", "0"], "argument --batch: --batch must be in [1, 256], got 0"),
    (["--draft-tokens", "65"], "argument --draft-tokens: --draft-tokens must be in [1, 64], got 65"),
    (["--trace", "/nonexistent/t.json.gz"], "/nonexistent/t.json.gz"),
    (["--cost-grid", "/nonexistent/cost.json"], "--cost-grid /nonexistent/cost.json"),
    # the same file twice (here as t.json.gz and ./t.json.gz) printed its rows twice
    (["--trace", "{trace}", "--trace", "{folder}/./t.json.gz"], "--trace lists {trace} more than once"),
])
def test_drained_call_bad_flags(argv, message, tmp_path, capsys) -> None:
    trace = tmp_path / "t.json.gz"
    save_trace(make_synthetic_trace(SyntheticSpec(prompts=2, n=2, steps=1, max_tokens=120, seed=2)), trace)
    argv = [a.format(trace=trace, folder=tmp_path) for a in argv]
    if "--trace" not in argv:
        argv = ["--trace", str(trace)] + argv
    message = message.format(trace=trace.resolve())
    assert message in argument_error(drained_call.main, argv, capsys)


def test_engine_bench_budget_state_counts_asks_priced_by_the_call_end(capsys) -> None:
    """The budget-state line says how many of the budget's calls the drained rule priced."""
    widths = (1, 2, 3, 5, 9)
    budget = budget_from_cost(CostModel((1, 8), widths, ((1e-3,) * 5, (1e-3,) * 5)), 8, 8)
    ids = np.arange(4)
    budget.set_running(ids, np.full(4, 10), draining=False)
    budget(4)
    budget.set_running(ids, np.full(4, 10), draining=True)
    budget(4)
    budget(4)
    engine_bench.print_budget_state(budget, [4], 0)
    assert "priced by the call's end (nothing waiting): 2" in capsys.readouterr().out


def test_drained_call_drafts_nothing_at_a_requests_prefill(monkeypatch) -> None:
    """A request's first forward is its prefill: no draft there, as in the engine and
    ``replay_step``. With an oracle drafter every 4-token response thus takes two forwards (it
    took one: the prefill drafted the whole response, TPF 4.0)."""
    from test_replay import OracleDrafter  # tests/ is on sys.path under pytest

    trace = Trace(prompts={g: [5, g] for g in range(16)},
                  steps=[[(g, [100 + g, 200 + g, 300 + g, 2]) for g in range(16)]] * 2)
    monkeypatch.setattr(drained_call, "NgramDrafter", lambda config: OracleDrafter(trace))
    for rule in drained_call.RULES:
        figures = drained_call.replay_rule(trace, rule, 16, 2, 8, drained_call.modelled_grid(8))
        assert [f.tokens for f in figures] == [64, 64]
        assert all(f.forwards >= 2 * 16 for f in figures) and all(f.tpf <= 2.0 for f in figures)


def test_draft_size_yield_counts_no_prefill_as_a_draft(tmp_path, monkeypatch, capsys) -> None:
    """E(k) is what a drafting step yields: with an oracle drafter every estimate is 1 + k. A
    prefill asks for no draft; counted as a tree that found nothing, it pulled the replayed
    estimates below the per-depth model's (8.27 at k = 8)."""
    from test_replay import OracleDrafter

    response = list(range(10, 100)) + [2]  # the prefill's token, then 90 = a multiple of 2, 3, 5, 9
    trace = Trace(prompts={0: [1, 2, 3]}, steps=[[(0, response), (0, response[::-1])]])
    path = tmp_path / "t.json"
    save_trace(trace, path)
    monkeypatch.setattr(draft_size_yield, "NgramDrafter", lambda config: OracleDrafter(trace))
    draft_size_yield.main(["--trace", str(path)])
    rows = {r[1]: [float(x) for x in r[2:]] for r in table_rows(capsys.readouterr().out)}
    expected = [1.0 + k for k in draft_size_yield.SIZES]
    assert rows == {"proposed at k": expected, "prefix of 8-node trees": expected, "per-depth model": expected}

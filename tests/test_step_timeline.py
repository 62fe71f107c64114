"""``bench/step_timeline.py``: a CPU smoke run (2-layer random model) of the host-time table, and
that its timers come off the engine afterwards."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from argument_errors import argument_error, hide_cuda  # noqa: E402
import engine_bench as eb  # noqa: E402
import step_timeline as st  # noqa: E402
from rollout_spec.engine import runner  # noqa: E402
from rollout_spec.engine.engine import RolloutEngine  # noqa: E402


def test_table_lists_both_engines_and_timers_come_off(monkeypatch, capsys) -> None:
    monkeypatch.setitem(eb.SMOLLM2_135M, "num_hidden_layers", 2)
    before = (RolloutEngine._decode, runner.ModelRunner.verify_forward, runner.host_tree_inputs)
    st.main(["--device", "cpu", "--random-weights", "--batch-size", "2", "--max-new-tokens", "4",
             "--rounds", "1", "--min-ms", "0"])
    out, err = capsys.readouterr()
    assert "engines built in " in err and "[round 1/1 done]" in err  # progress on stderr only
    assert "round 1/1" not in out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert "## Host time per decode step, B=2, T=0.6" in out
    # Every decode step goes through _decode on both engines; only the spec engine proposes.
    assert all(float(x) > 0 for x in rows["RolloutEngine._decode"].split("|")[2:4])
    assert float(rows["RolloutEngine._budgets"].split("|")[3]) > 0
    assert (RolloutEngine._decode, runner.ModelRunner.verify_forward, runner.host_tree_inputs) == before
    import torch
    assert "cpu" not in torch.Tensor.__dict__  # the inherited method is back


def test_fixed_budget_drafts_every_spec_step(monkeypatch, capsys) -> None:
    """``--fixed-budget K`` replaces the budget: every spec step offers each request K nodes,
    or fewer where it has room to keep fewer (``RolloutEngine._capped``)."""
    monkeypatch.setitem(eb.SMOLLM2_135M, "num_hidden_layers", 2)
    offered = []
    real = RolloutEngine._budgets

    def spy(self, run):
        budgets = real(self, run)
        if self._drafter is not None:
            room = run.room(self.max_model_len) - 1
            offered.append((budgets.tolist(), [min(3, max(r, 0)) for r in room.tolist()]))
        return budgets

    monkeypatch.setattr(RolloutEngine, "_budgets", spy)
    st.main(["--device", "cpu", "--random-weights", "--batch-size", "2", "--max-new-tokens", "6",
             "--rounds", "1", "--min-ms", "0", "--fixed-budget", "3"])
    # Without the option a CPU engine offers ``--draft-tokens`` (32) where there is room: 4 here.
    assert offered and all(got == want for got, want in offered)
    assert offered[0] == ([3, 3], [3, 3])
    with pytest.raises(SystemExit):
        st.main(["--fixed-budget", "0"])
    assert "--fixed-budget" in capsys.readouterr().err


def test_bad_batch_size_names_the_flag(capsys) -> None:
    with pytest.raises(SystemExit):
        st.main(["--batch-size", "0"])
    assert "--batch-size" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--temperature", "-1"], "argument --temperature: --temperature must be 0 (greedy) or in [0.01, 100.0], got -1.0"),
    (["--min-ms", "-1"], "argument --min-ms: --min-ms must be in [0.0, 1000000.0]"),
    (["--device", "foo"], "argument --device: device must be auto, cpu, mps, cuda or cuda:N"),
    (["--device", "cpu", "--random-weights", "--max-new-tokens", "1000"],
     "--max-new-tokens 1000: prompt length 128 + 1000 new tokens exceeds --max-model-len 1024"),
    # the engine cut the fixed answer to --draft-tokens: the table showed 32-node steps as 64's
    (["--device", "cpu", "--random-weights", "--fixed-budget", "64"],
     "--fixed-budget 64 must be at most --draft-tokens 32, the engine's most draft nodes per request"),
])
def test_errors_name_this_scripts_flags(argv, message, monkeypatch, capsys) -> None:
    """Its own usage and flags, never engine_bench's (--temperatures, --batch-sizes), and no model."""
    monkeypatch.setattr(eb, "build_engines", lambda _args: pytest.fail("engines built before the error"))
    err = argument_error(st.main, argv, capsys)
    assert message in err
    assert "[--batch-size BATCH_SIZE]" in err  # its own usage
    assert "--temperatures" not in err and "--batch-sizes" not in err


def test_cuda_without_a_gpu_exits(monkeypatch, capsys) -> None:
    hide_cuda(monkeypatch)
    monkeypatch.setattr(eb, "build_engines", lambda _args: pytest.fail("engines built before the error"))
    err = argument_error(st.main, ["--device", "cuda", "--random-weights"], capsys)
    assert "--device cuda: no CUDA device is visible here" in err

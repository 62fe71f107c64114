"""``bench/step_timeline.py``: a CPU smoke run (2-layer random model) of the host-time table, and
that its timers come off the engine afterwards."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import engine_bench as eb  # noqa: E402
import step_timeline as st  # noqa: E402
from rollout_spec.engine import runner  # noqa: E402
from rollout_spec.engine.engine import RolloutEngine  # noqa: E402


def test_table_lists_both_engines_and_timers_come_off(monkeypatch, capsys) -> None:
    monkeypatch.setitem(eb.SMOLLM2_135M, "num_hidden_layers", 2)
    before = (RolloutEngine._decode, runner.ModelRunner.verify_forward, runner.host_tree_inputs)
    st.main(["--device", "cpu", "--random-weights", "--batch-size", "2", "--max-new-tokens", "4",
             "--rounds", "1", "--min-ms", "0"])
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert "## Host time per decode step, B=2, T=0.6" in out
    # Every decode step goes through _decode on both engines; only the spec engine proposes.
    assert all(float(x) > 0 for x in rows["RolloutEngine._decode"].split("|")[2:4])
    assert float(rows["RolloutEngine._budgets"].split("|")[3]) > 0
    assert (RolloutEngine._decode, runner.ModelRunner.verify_forward, runner.host_tree_inputs) == before
    import torch
    assert "cpu" not in torch.Tensor.__dict__  # the inherited method is back


def test_bad_batch_size_names_the_flag(capsys) -> None:
    with pytest.raises(SystemExit):
        st.main(["--batch-size", "0"])
    assert "--batch-size" in capsys.readouterr().err

"""A CPU smoke run of ``bench/shared_index_bench.py``: a table row and a progress line per step."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="the shared index needs Ray: pip install 'rollout-spec[ray]'")
BENCH = str(Path(__file__).resolve().parents[1] / "bench")
sys.path.insert(0, BENCH)

from bench_traces import small_trace  # noqa: E402
from markdown_table import table_rows  # noqa: E402
import shared_index_bench  # noqa: E402


def test_each_step_prints_a_row_and_a_progress_line(tmp_path, monkeypatch, capsys) -> None:
    # Ray's workers import the script's actor class by module name: bench/ on their path too
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [BENCH, os.environ.get("PYTHONPATH")])))
    shared_index_bench.main(["--trace", str(small_trace(tmp_path)), "--replicas", "2", "--hosts", "1",
                             "--requests", "8", "--n", "4", "--steps", "2", "--sink", "count"])
    out, err = capsys.readouterr()
    assert [r[0] for r in table_rows(out)] == ["0", "1"]
    assert "[step 1/2: published and ingested in " in err and "[step 2/2: " in err
    assert "published and ingested" not in out  # progress stays off the table's stream

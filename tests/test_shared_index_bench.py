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


@pytest.mark.parametrize("args, message", [
    (["--replicas", "2", "--shards", "3"], "--shards 3 must be at most --replicas 2"),  # a shard serving none
    (["--replicas", "65536", "--requests", "1048576"], "= 68719476736 responses per step; at most 1048576"),
])
def test_shards_beyond_the_replicas_and_a_huge_step_are_argument_errors(
        tmp_path, monkeypatch, capsys, args: list[str], message: str) -> None:
    """Both ran: coordinator actors that never got a publication, or an allocation of terabytes."""
    monkeypatch.setattr(shared_index_bench.ray, "init", lambda **kw: pytest.fail("Ray was started"))
    with pytest.raises(SystemExit) as exit_info:
        shared_index_bench.main(["--trace", str(small_trace(tmp_path)), "--hosts", "1", "--n", "4", "--requests", "8",
                                 *args])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err

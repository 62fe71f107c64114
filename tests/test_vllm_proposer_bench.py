"""CPU smoke runs of ``bench/vllm_proposer_bench.py``: its table, the digests that compare two
versions of the proposer, and its flag errors."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from argument_errors import argument_error  # noqa: E402
from bench_traces import small_trace  # noqa: E402
import vllm_proposer_bench  # noqa: E402
from markdown_table import table_rows  # noqa: E402


def test_replays_print_a_row_per_step_and_write_matching_digests(tmp_path, capsys) -> None:
    trace, digest = small_trace(tmp_path), tmp_path / "d.json"
    vllm_proposer_bench.main(["--trace", str(trace), "--max-live", "8", "--repeat", "2",
                              "--digest", str(digest)])
    out, err = capsys.readouterr()
    rows = table_rows(out)
    assert [r[1] for r in rows] == ["0", "1"]
    assert "[t, 2 replays: replayed in " in err and "replayed in" not in out  # progress on stderr
    assert all(int(r[2]) > 0 and float(r[3]) >= 1.0 for r in rows)
    assert float(rows[1][3]) > 1.0  # step 1 drafts from step 0's siblings, which share spans
    assert all(len(r[4].split("(")[1].split()) == 2 for r in rows)  # both runs' figures shown
    steps = json.loads(digest.read_text())["t"]
    assert len(steps) == 2 and all(steps)
    vllm_proposer_bench.main(["--trace", str(trace), "--max-live", "8", "--digest", str(digest)])
    assert json.loads(digest.read_text())["t"] == steps  # the same proposer proposes the same
    vllm_proposer_bench.main(["--trace", str(trace), "--max-live", "8", "--tree", "--digest", str(digest)])
    assert json.loads(digest.read_text())["t"] != steps  # trees are not the chains


def test_bad_flags_are_argument_errors(tmp_path, capsys) -> None:
    trace = str(small_trace(tmp_path))
    for flag, value in (("--max-live", "0"), ("--k", "65"), ("--repeat", "0")):
        assert f"{flag} must be in" in argument_error(vllm_proposer_bench.main, ["--trace", trace, flag, value],
                                                      capsys)


def test_an_unwritable_digest_is_refused_before_the_replays(tmp_path, capsys) -> None:
    """``--digest`` in a missing folder, or naming a directory, raised a traceback after every
    replay had run (their figures lost); it is now an argument error before any replay."""
    trace = str(small_trace(tmp_path))
    for digest, reason in ((tmp_path / "missing" / "d.json", "does not exist"), (tmp_path, "is a directory")):
        err = argument_error(vllm_proposer_bench.main, ["--trace", trace, "--digest", str(digest)], capsys)
        assert f"--digest {digest}: " in err and reason in err
    assert "| t |" not in capsys.readouterr().out


def test_a_response_past_the_default_model_length_is_replayed_whole(tmp_path, capsys) -> None:
    """A trace whose prompt and response exceed the replay's 2048-token model length: the row
    went on past it with its tokens dropped from the runner's table and no drafts, figures of
    steps vLLM never runs. The replay's model length now fits the trace."""
    from rollout_spec.replay import Trace, save_trace

    period = [1000 + i for i in range(40)]  # a response the drafter learns after one period
    path = tmp_path / "long.json.gz"
    save_trace(Trace(prompts={0: [5, 6, 7]}, steps=[[(0, (period * 80)[:3000])]]), path)
    vllm_proposer_bench.main(["--trace", str(path), "--max-live", "1"])
    (row,) = table_rows(capsys.readouterr().out)
    assert int(row[2]) < 3000 / 4  # engine steps: drafts go on being accepted past token 2048


def test_traces_of_one_name_are_refused_with_a_digest(tmp_path, capsys) -> None:
    """``--digest`` keys each trace's entries by its name: of two traces named t, the first's
    entries were silently replaced by the second's. The same file twice is refused as such."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, second = small_trace(tmp_path / "a", seed=1), small_trace(tmp_path / "b", seed=2)
    argv = ["--trace", str(first), "--trace", str(second), "--max-live", "8"]
    err = argument_error(vllm_proposer_bench.main, argv + ["--digest", str(tmp_path / "d.json")], capsys)
    assert f"--digest: traces {first} and {second} are both named 't', the key of their entries" in err
    assert not (tmp_path / "d.json").exists()
    err = argument_error(vllm_proposer_bench.main, ["--trace", str(first), "--trace", str(first)], capsys)
    assert f"--trace lists {first.resolve()} more than once" in err

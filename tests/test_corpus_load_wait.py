"""CPU smoke run of ``bench/corpus_load_wait.py``: both loads in its table, the adapter's batch
size left as it was, and its flag errors."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from argument_errors import argument_error  # noqa: E402
import corpus_load_wait  # noqa: E402
from markdown_table import table_rows  # noqa: E402
from rollout_spec.integrations.sglang import corpus as corpus_module  # noqa: E402


def test_both_loads_are_timed_in_one_table(capsys) -> None:
    batch = corpus_module.LOAD_BATCH_TOKENS
    corpus_load_wait.main(["--documents", "40", "--doc-tokens", "30", "--get-every-ms", "0",
                           "--rounds", "2"])
    out = capsys.readouterr().out
    assert "40 documents, 1,239 tokens" in out  # 40 x 30 tokens and 39 separators
    rows = table_rows(out)
    assert [(r[0], r[1]) for r in rows] == [(f"batches of {batch:,} tokens", "1"), ("one call", "1"),
                                            (f"batches of {batch:,} tokens", "2"), ("one call", "2")]
    assert all(float(r[2]) >= 0 and int(r[3]) >= 0 for r in rows)
    assert corpus_module.LOAD_BATCH_TOKENS == batch


def test_loads_the_whole_corpus_whichever_way() -> None:
    chunks = corpus_load_wait.corpus_chunks(5, 7)
    assert [len(c) for c in chunks] == [7, 8, 8, 8, 8] and chunks[1][0] == corpus_module.SEPARATOR_TOKEN
    for batch in (7, 10_000):
        seconds, waits = corpus_load_wait.waits_during_load(chunks, batch, 0.0)
        assert seconds > 0 and all(w >= 0 for w in waits)


def test_bad_flags_are_argument_errors(capsys) -> None:
    for flag, value in (("--documents", "0"), ("--doc-tokens", "x"), ("--get-every-ms", "-1"),
                        ("--rounds", "101")):
        assert f"{flag} must be" in argument_error(corpus_load_wait.main, [flag, value], capsys)


def test_a_corpus_too_large_to_build_is_refused_before_it_is_built(monkeypatch, capsys) -> None:
    """Each flag allows a million: together 10**12 tokens, which the script began to draw as
    Python lists until it ran out of memory."""
    monkeypatch.setattr(corpus_load_wait, "corpus_chunks", lambda *_: pytest.fail("corpus built"))
    err = argument_error(corpus_load_wait.main, ["--documents", "1000000", "--doc-tokens", "101"], capsys)
    assert "--documents 1000000 x --doc-tokens 101 must be at most 100,000,000 corpus tokens, got 101,000,000" in err

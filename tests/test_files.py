"""files.replaced_on_success: a file is replaced whole or left as it was."""
from __future__ import annotations

import json

import pytest

from rollout_spec.files import replaced_on_success
from rollout_spec.replay import Trace, load_trace, save_trace


def test_success_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "out.txt"
    path.write_text("old")
    with replaced_on_success(path) as tmp:
        assert tmp.parent == tmp_path and tmp != path
        tmp.write_text("new")
        assert path.read_text() == "old"  # nothing changes until the block ends
    assert path.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


@pytest.mark.parametrize("stop", [RuntimeError, KeyboardInterrupt])
def test_a_failed_block_keeps_the_old_file(tmp_path, stop):
    path = tmp_path / "out.txt"
    path.write_text("old")
    with pytest.raises(stop):
        with replaced_on_success(path) as tmp:
            tmp.write_text("half")
            raise stop
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_an_interrupted_trace_save_keeps_the_earlier_trace(tmp_path, monkeypatch):
    path = tmp_path / "t.json.gz"
    first = Trace(prompts={1: [5, 6]}, steps=[[(1, [7, 8])]])
    save_trace(first, path)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(json, "dump", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_trace(Trace(prompts={2: [9]}, steps=[[(2, [1])]]), path)
    monkeypatch.undo()
    assert load_trace(path).prompts == {1: [5, 6]}
    assert [p.name for p in tmp_path.iterdir()] == ["t.json.gz"]

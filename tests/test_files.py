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


def test_two_writers_of_one_path_never_share_a_temporary(tmp_path):
    """Both blocks are open at once (two threads of one process): each writes its own temporary,
    and the file ends whole, as one of them wrote it."""
    import threading

    path = tmp_path / "out.txt"
    both_open = threading.Barrier(2)
    temporaries = []

    def write(text):
        with replaced_on_success(path) as tmp:
            temporaries.append(tmp)
            with open(tmp, "w") as f:
                f.write(text[:500])
                both_open.wait()
                f.write(text[500:])

    threads = [threading.Thread(target=write, args=(c * 1000,)) for c in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(temporaries)) == 2
    assert path.read_text() in ("a" * 1000, "b" * 1000)
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_a_directory_path_long_names_and_the_blocks_own_error(tmp_path):
    with pytest.raises(IsADirectoryError, match="names a directory"):
        with replaced_on_success(f"{tmp_path}/sub/"):
            pass
    long = tmp_path / ("n" * 250)  # a legal name; name + suffix would not be
    with replaced_on_success(long) as tmp:
        tmp.write_text("x")
    assert long.read_text() == "x"
    (tmp_path / "a_file").write_text("")
    with pytest.raises(RuntimeError, match="the block's"):  # not the cleanup's NotADirectoryError
        with replaced_on_success(tmp_path / "a_file" / "out.txt"):
            raise RuntimeError("the block's")


@pytest.mark.parametrize("name", [".", "..", "sub/.."])
def test_a_dot_path_is_a_directory_refused_before_the_block(tmp_path, name):
    """``..`` ran the block, then failed to rename its file onto a directory: the work was lost."""
    ran = []
    with pytest.raises(IsADirectoryError, match="names a directory"):
        with replaced_on_success(f"{tmp_path}/{name}"):
            ran.append(True)
    assert ran == [] and not list(tmp_path.rglob("*.tmp"))


def test_an_empty_path_is_refused_as_opening_it_would_be():
    with pytest.raises(FileNotFoundError, match="an empty path names no file"):
        with replaced_on_success(""):
            pass

"""Argument checks of the example data writers: errors before any file is touched, atomic writes."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from argument_errors import argument_error

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(relpath: str, name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / relpath)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def prompts():
    pytest.importorskip("reasoning_gym")
    return _load("openrlhf/make_prompts.py", "make_prompts")


@pytest.fixture
def gsm():
    return _load("verl/make_gsm_data.py", "make_gsm_data")


@pytest.mark.parametrize("argv,message", [
    (["--size", "0"], "size must be in [1,"),
    (["--size", "-3"], "size must be in [1,"),
    (["--tasks", "basic_arithmetic", "nosuch"], "every --tasks value must be a reasoning-gym task"),
    (["--seed", "-1"], "--seed must be in [0,"),
    # each task's prompts were written twice, the same ones (one seed)
    (["--tasks", "chain_sum", "basic_arithmetic", "chain_sum"], "--tasks lists chain_sum more than once"),
])
def test_make_prompts_refuses_bad_options_and_keeps_the_old_file(prompts, tmp_path, capsys, argv, message):
    out = tmp_path / "p.jsonl"
    out.write_text('{"prompt": "good", "label": "1"}\n')
    assert message in argument_error(prompts.main, ["--out", str(out), *argv], capsys)
    assert out.read_text() == '{"prompt": "good", "label": "1"}\n'


def test_make_prompts_failure_midway_leaves_no_truncated_file(prompts, tmp_path, monkeypatch):
    out = tmp_path / "p.jsonl"
    out.write_text("old\n")
    real = prompts.reasoning_gym.create_dataset

    class Midway:  # chain_sum's middle prompt fails: its first and last draw fine
        def __init__(self, dataset):
            self.dataset = dataset

        def __getitem__(self, i):
            if i == 1:
                raise RuntimeError("boom")
            return self.dataset[i]

        def __iter__(self):
            return (self[i] for i in range(len(self.dataset)))

    def flaky(task, size, seed):
        dataset = real(task, size=size, seed=seed)
        return Midway(dataset) if task == "chain_sum" else dataset

    monkeypatch.setattr(prompts.reasoning_gym, "create_dataset", flaky)
    with pytest.raises(RuntimeError):
        prompts.main(["--out", str(out), "--size", "3", "--tasks", "basic_arithmetic", "chain_sum"])
    assert out.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["p.jsonl"]


@pytest.mark.parametrize("argv,message", [
    (["--tasks", "composite"], "--tasks composite with --seed 0: reasoning-gym cannot make 2 prompts"),
    (["--tasks", "pool_matrix", "--seed", str(2**32 - 1)],
     f"--tasks pool_matrix with --seed {2**32 - 1}: reasoning-gym cannot make 2 prompts (ValueError"),
])
def test_make_prompts_refuses_a_task_that_cannot_make_its_prompts(prompts, tmp_path, capsys, argv, message):
    """Registered tasks that fail to generate (composite needs a config; pool_matrix seeds numpy
    with seed + index, below 2**32) were a traceback after the write had begun."""
    out = tmp_path / "p.jsonl"
    assert message in argument_error(prompts.main, ["--out", str(out), "--size", "2", *argv], capsys)
    assert not out.exists()


def test_make_prompts_refused_leaves_no_folder_behind(prompts, tmp_path, capsys):
    """The task check runs before ``--out``'s folder is made: a refused run creates nothing."""
    out = tmp_path / "new" / "sub" / "p.jsonl"
    err = argument_error(prompts.main, ["--out", str(out), "--size", "2", "--tasks", "composite"], capsys)
    assert "--tasks composite with --seed 0: reasoning-gym cannot make 2 prompts" in err
    assert list(tmp_path.iterdir()) == []


def test_make_prompts_writes_every_task(prompts, tmp_path, capsys):
    out = tmp_path / "sub" / "p.jsonl"
    assert prompts.main(["--out", str(out), "--size", "2", "--tasks", "basic_arithmetic", "chain_sum"]) == 0
    assert len(out.read_text().splitlines()) == 4 and "wrote 4 prompts" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--train-size", "0"], "--train-size must be in [1,"),
    (["--train-size", "3", "--test-size", "-1"], "--test-size must be in [1,"),
])
def test_make_gsm_data_refuses_bad_sizes_before_writing(gsm, tmp_path, capsys, argv, message):
    (tmp_path / "train.parquet").write_text("old train")
    assert message in argument_error(gsm.main, ["--out", str(tmp_path), *argv], capsys)
    assert (tmp_path / "train.parquet").read_text() == "old train"


def test_make_gsm_data_refuses_an_empty_out(gsm, tmp_path, monkeypatch, capsys):
    """``--out ""`` (an unset variable in ``--out "$DIR"``) wrote both files to the current
    folder."""
    monkeypatch.chdir(tmp_path)
    err = argument_error(gsm.main, ["--out", "", "--train-size", "1", "--test-size", "1"], capsys)
    assert "argument --out: must be a path, got ''" in err and list(tmp_path.iterdir()) == []


def test_make_gsm_data_names_the_missing_packages(gsm, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pyarrow" else object())
    err = argument_error(gsm.main, ["--out", str(tmp_path / "d"), "--train-size", "2"], capsys)
    assert "needs pyarrow: pip install 'rollout-spec[verl]'" in err and not (tmp_path / "d").exists()


def test_make_gsm_data_writes_nothing_unless_both_splits_build(gsm, tmp_path, monkeypatch):
    pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    pytest.importorskip("reasoning_gym")
    (tmp_path / "train.parquet").write_text("old train")
    real = gsm.rows
    monkeypatch.setattr(gsm, "rows", lambda split, size, seed: real(split, size, seed) if split == "train"
                        else (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError):
        gsm.main(["--out", str(tmp_path), "--train-size", "2", "--test-size", "2"])
    assert (tmp_path / "train.parquet").read_text() == "old train"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.parquet"]


def test_make_gsm_data_writes_both_splits_as_verl_rows(gsm, tmp_path, capsys):
    """Each split's parquet file reads back as the rows ``rows`` builds for it (verl's schema, nested
    prompt and reward_model included), and no temporary file is left behind."""
    pd = pytest.importorskip("pandas")
    pytest.importorskip("reasoning_gym")
    assert gsm.main(["--out", str(tmp_path), "--train-size", "3", "--test-size", "2"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["test.parquet", "train.parquet"]
    out = capsys.readouterr().out
    for split, size in (("train", 3), ("test", 2)):
        assert f"wrote {size} rows to {tmp_path / f'{split}.parquet'}" in out
        read = pd.read_parquet(tmp_path / f"{split}.parquet")
        back = [{k: v.tolist() if hasattr(v, "tolist") else v for k, v in row.items()}
                for row in read.to_dict("records")]
        assert back == gsm.rows(split, size, gsm.SEEDS[split])

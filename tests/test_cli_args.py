"""The shared argument types and up-front checks: errors name the option and its range."""
import argparse

import pytest

from rollout_spec.cli_args import (DefaultsParser, check_device, check_distinct, check_output, check_triton_backend,
                                   device_arg, float_arg, int_arg, load_trace_arg, names_arg, numbers_arg, path_arg,
                                   temperatures_arg)


@pytest.mark.parametrize("parse, text, needle", [
    (int_arg("steps", 1, 10), "0", "steps must be in [1, 10], got 0"),
    (int_arg("steps", 1), "x", "steps must be an integer in [1, inf], got 'x'"),
    (float_arg("top_p", 0.0, 1.0, lo_open=True), "high", "top_p must be a number in (0.0, 1.0], got 'high'"),
    (float_arg("top_p", 0.0, 1.0, lo_open=True), "0", "top_p must be in (0.0, 1.0]"),
    (float_arg("temperature", 0.0, 2.0), "nan", "temperature must be in [0.0, 2.0], got nan"),
    (numbers_arg("batch_sizes", int, 1, 64), "1,0", "every batch_sizes value must be in [1, 64], got 0"),
    (numbers_arg("batch_sizes", int, 1, 64), "1,a", "batch_sizes must be comma-separated integers, got '1,a'"),
    (numbers_arg("temperatures", float, 0.0, 2.0), "nan", "every temperatures value must be in [0.0, 2.0]"),
    (temperatures_arg("temps"), "0.6,-1", "every temps value must be 0 (greedy) or in [0.01, 100.0], got -1.0"),
    (temperatures_arg("temps"), "0.001", "every temps value must be 0 (greedy) or in [0.01, 100.0], got 0.001"),
    (temperatures_arg("temps"), "0.6,", "temps must be comma-separated numbers, got '0.6,'"),
    (names_arg("modes", ("chain", "tree")), "chain,bush", "every modes value must be one of chain, tree; got 'bush'"),
    (device_arg, "gpu", "device must be auto, cpu, mps, cuda or cuda:N, got 'gpu'"),
    # a repeated value ran its rows twice
    (numbers_arg("batch_sizes", int, 1, 64), "8,1,8,1", "batch_sizes lists 8, 1 more than once"),
    (temperatures_arg("temps"), "0.6,0.60", "temps lists 0.6 more than once"),
    (names_arg("modes", ("chain", "tree")), "tree, tree", "modes lists tree more than once"),
    (path_arg, "", "must be a path, got ''"),  # Path('') is the current folder
])
def test_types_name_the_option_and_range(parse, text, needle):
    with pytest.raises(argparse.ArgumentTypeError) as got:
        parse(text)
    assert needle in str(got.value)


def test_types_return_the_parsed_values():
    assert int_arg("n", 1, 8)("8") == 8 and numbers_arg("b", int, 1, 64)("1,64") == [1, 64]
    assert names_arg("m", ("a", "b"))("b, a") == ["b", "a"] and device_arg("cuda:1") == "cuda:1"
    assert temperatures_arg("t")("0,0.6,100") == [0.0, 0.6, 100.0]


class Refused(Exception):
    pass


class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise Refused(message)


def test_outputs_and_traces_are_checked_before_work(tmp_path):
    check_output(Parser(), "--out", tmp_path / "ok.json")
    check_output(Parser(), "--out", None)
    with pytest.raises(Refused, match="--out .*: folder .*missing does not exist"):
        check_output(Parser(), "--out", tmp_path / "missing" / "x.json")
    with pytest.raises(Refused, match="is a directory"):
        check_output(Parser(), "--out", tmp_path)
    (tmp_path / "file").write_text("")  # was "folder .../file does not exist"
    with pytest.raises(Refused, match=r"--out .*file/x\.json: .*file is not a folder"):
        check_output(Parser(), "--out", tmp_path / "file" / "x.json")
    with pytest.raises(Refused, match="--trace .*nope.json: trace file not found"):
        load_trace_arg(Parser(), "--trace", tmp_path / "nope.json")
    with pytest.raises(Refused, match="--trace .*: is a directory, not a trace file"):
        load_trace_arg(Parser(), "--trace", tmp_path)
    (tmp_path / "bad.json").write_text("[]")
    with pytest.raises(Refused, match="--trace .*bad.json: a trace needs 'prompts' and 'steps'"):
        load_trace_arg(Parser(), "--trace", tmp_path / "bad.json")
    (tmp_path / "empty.json").write_text('{"prompts": [], "steps": []}')
    assert load_trace_arg(Parser(), "--trace", tmp_path / "empty.json").steps == []
    with pytest.raises(Refused, match=r"empty.json: every step must hold responses \(it has 0 steps\)"):
        load_trace_arg(Parser(), "--trace", tmp_path / "empty.json", need_responses=True)


def test_a_cuda_device_is_refused_where_torch_sees_none(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(Refused, match="--device cuda:0: no CUDA device is visible here"):
        check_device(Parser(), "cuda:0")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(Refused, match=r"--device cuda:2: torch sees 2 CUDA devices here \(cuda:0 to cuda:1\)"):
        check_device(Parser(), "cuda:2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert check_device(Parser(), "cpu") == "cpu" and check_device(Parser(), "auto") == "cpu"


def test_defaults_parser_states_each_set_default_in_help():
    """Every option with a set default shows it, help text or not; unset, off and empty ones do
    not; help holding %(default)s places it itself; subcommand parsers follow the same rule."""
    parser = DefaultsParser(prog="p")
    parser.add_argument("--steps", type=int_arg("--steps", 1), default=2)
    parser.add_argument("--n", default=4, help="samples per prompt")
    parser.add_argument("--cap", default=256, help="at most min(n, %(default)s)")
    parser.add_argument("--plot", default=None, help="write a PNG")
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--profile", type=numbers_arg("--profile", int, 1, 8), default=[], help="these B")
    parser.add_argument("trace", help="a trace file")
    sub = parser.add_subparsers().add_parser("replay")
    sub.add_argument("--draft-tokens", default=8)
    text = " ".join(parser.format_help().split())
    assert "--steps STEPS (default: 2)" in text and "samples per prompt (default: 4)" in text
    assert "at most min(n, 256)" in text and text.count("default") == 2  # --steps and --n only
    assert "write a PNG" in text and "a smoke run" in text and "these B" in text and "a trace file" in text
    assert isinstance(sub, DefaultsParser) and "(default: 8)" in sub.format_help()


def test_defaults_parser_writes_a_list_default_as_typed():
    """An nargs option's list default reads as its values typed on the command line, not as a
    Python list ("['a', 'b']"); a % in a value is not taken for a format."""
    parser = DefaultsParser(prog="p")
    parser.add_argument("--tasks", nargs="+", default=["basic_arithmetic", "chain_sum"])
    parser.add_argument("--fmt", nargs="+", default=("5%",))
    text = " ".join(parser.format_help().split())
    assert "(default: basic_arithmetic chain_sum)" in text and "(default: 5%)" in text


def test_mps_where_torch_has_none_is_an_argument_error(monkeypatch):
    import torch

    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(Refused, match=r"--device: device 'mps': MPS is not available here \(use 'cpu'\)"):
        check_device(Parser(), "mps")


def test_an_output_folder_that_cannot_be_written_is_refused(tmp_path, monkeypatch):
    import os

    monkeypatch.setattr(os, "access", lambda path, mode: False)  # as for a read-only folder (root may write any)
    with pytest.raises(Refused, match=r"--out .*x\.json: folder .* is not writable"):
        check_output(Parser(), "--out", tmp_path / "x.json")


def test_a_task_registry_broken_by_another_missing_module_is_not_blamed_on_reasoning_gym(monkeypatch):
    """Only reasoning-gym missing is the install hint; any other missing module is re-raised as is."""
    from rollout_spec import workloads
    from rollout_spec.cli_args import task_arg

    def missing(module: str):
        def task_names() -> list[str]:
            raise ModuleNotFoundError(f"No module named {module!r}", name=module)
        return task_names

    monkeypatch.setattr(workloads, "task_names", missing("sympy"))
    with pytest.raises(ModuleNotFoundError, match="sympy"):
        task_arg("chain_sum")
    monkeypatch.setattr(workloads, "task_names", missing("reasoning_gym.core"))
    with pytest.raises(argparse.ArgumentTypeError, match=r"needs reasoning-gym, not installed"):
        task_arg("chain_sum")


def test_check_distinct_names_the_repeated_values():
    check_distinct(Parser(), "--tasks", ["a", "b"])
    with pytest.raises(Refused, match="^--tasks lists b, a more than once$"):
        check_distinct(Parser(), "--tasks", ["a", "b", "b", "a", "b"])


def test_the_triton_backend_is_refused_where_its_kernels_cannot_run(monkeypatch):
    """Off CUDA the kernels fail in triton's driver ("0 active drivers") once a model is built,
    unless TRITON_INTERPRET=1 has triton's interpreter run them on the CPU."""
    from rollout_spec.engine import triton_attention

    monkeypatch.setattr(triton_attention, "is_available", lambda: False)
    with pytest.raises(Refused, match=r"^--backends triton: the triton package is not installed \(use auto"):
        check_triton_backend(Parser(), "--backends", "cuda:0")
    monkeypatch.setattr(triton_attention, "is_available", lambda: True)
    check_triton_backend(Parser(), "--backends", "cuda:0")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(Refused, match="^--backends triton: the Triton kernels run on CUDA, not on --device cpu"):
        check_triton_backend(Parser(), "--backends", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    check_triton_backend(Parser(), "--backends", "cpu")

"""``rollout-spec`` argument errors and the bench loop over a stand-in engine (engine contract)."""
from __future__ import annotations

import gzip
import json
import time
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from rich.console import Console

from argument_errors import argument_error

from rollout_spec import cli
from rollout_spec.replay import load_trace


@pytest.mark.parametrize("argv, needle", [
    (["bench", "--steps", "0"], "--steps: --steps must be in [1, 100000], got 0"),
    (["bench", "--n", "four"], "--n: --n must be an integer in [1, 1024], got 'four'"),
    (["bench", "--temperature", "-1"], "--temperature: --temperature must be 0 (greedy) or in [0.01, 100.0], got -1.0"),
    (["bench", "--temperature", "1e-9"], "--temperature: --temperature must be 0 (greedy) or in [0.01, 100.0]"),
    (["bench", "--top-p", "0"], "--top-p: --top-p must be in (0.0, 1.0]"),
    (["bench", "--top-k", "0"], "--top-k: --top-k must be -1 (keep all) or >= 1"),
    (["bench", "--top-k", "3000000000"], "--top-k: --top-k must be in [-1, 2147483648]"),
    (["bench", "--task", "humaneval", "--prompts", "165", "--wandb", "disabled"],
     "--prompts must be <= 164 for humaneval, got 165"),
    (["bench", "--task", "humaneval", "--prompts", "100", "--steps", "2", "--fresh-prompts", "--wandb", "disabled"],
     "--prompts x --steps (with --fresh-prompts) must be <= 164 for humaneval, got 200"),
    (["bench", "--draft-tokens", "0"], "--draft-tokens: --draft-tokens must be in [1, 1024]"),
    (["bench", "--max-new-tokens", "1.5"], "--max-new-tokens must be an integer"),
    (["bench", "--device", "gpu"], "device must be auto, cpu, mps, cuda or cuda:N"),
    (["bench", "--task", "no_such_task"], "--task: task must be a reasoning-gym task"),
    (["bench", "--wandb", "sometimes"], "invalid choice: 'sometimes'"),
    (["bench", "--record", "trace.txt", "--wandb", "disabled"], "--record must end in .json"),
    ([], "the following arguments are required: command"),
    (["replay", "/no/such/trace.json"], "trace file not found"),
    (["bench", "--plot", "dash.svg"], "--plot must end in .png, got 'dash.svg'"),
    (["bench", "--json", "/no/such/dir/out.json"], "--json /no/such/dir/out.json: folder /no/such/dir does not exist"),
    (["bench", "--record", "/no/such/dir/t.json.gz"], "--record /no/such/dir/t.json.gz: folder /no/such/dir does not exist"),
    (["bench", "--json", "/"], "--json /: is a directory"),
    (["bench", "--record", "out.json", "--json", "./out.json", "--wandb", "disabled"],
     "--record and --json name the same file 'out.json': give each its own"),
    (["bench", "--plot", "d.png", "--json", "d.png", "--wandb", "disabled"], "--plot and --json name the same file"),
    (["bench", "--model", "no-such-model"], "argument --model: model must be one of ['smollm2-135m'], a .gguf"),
    (["bench", "--record", "t.tar.gz", "--wandb", "disabled"], "--record must end in .json or .json.gz, got 't.tar.gz'"),
    # refused as parsed, not by wandb.init after the model has loaded (a traceback)
    (["bench", "--wandb-project", "team/runs"],
     "--wandb-project must not contain any of / \\ # ? % :, got 'team/runs' (with /)"),
    (["bench", "--wandb-project", "p" * 129], "--wandb-project must be at most 128 characters, got 129"),
    # a name longer than the filesystem's 255 bytes: was an OSError traceback from Path.is_dir
    (["bench", "--json", "r" * 300 + ".json", "--wandb", "disabled"],
     "the file name is 305 bytes, its filesystem allows at most 255"),
    (["bench", "--plot", "/tmp/" + "d" * 300 + ".png", "--wandb", "disabled"], "the file name is 304 bytes"),
    (["replay", "t" * 300 + ".json"], "the file name is 305 bytes, its filesystem allows at most 255"),
    (["replay", "/tmp/" + "/".join(["d" * 200] * 25) + "/t.json"], "File name too long"),
])
def test_argument_errors(capsys, argv, needle):
    assert needle in argument_error(cli.main, argv, capsys)


@pytest.mark.parametrize("text, top_k", [("-1", -1), ("1", 1), ("50", 50)])
def test_top_k_takes_minus_one_or_a_positive_count(text, top_k):
    """The values --top-k's refusals leave allowed are parsed as the int SamplingParams takes."""
    assert cli.build_parser().parse_args(["bench", "--top-k", text]).top_k == top_k


@pytest.mark.parametrize("argv", [["bench", "--plot", "d.jpg"], ["replay", "/no/such/trace.json"]])
def test_checks_after_parsing_report_as_the_subcommand(capsys, argv):
    """Their usage line and prefix are the subcommand's, as argparse's own errors are."""
    err = argument_error(cli.main, argv, capsys)
    assert err.startswith(f"usage: rollout-spec {argv[0]} ") and f"rollout-spec {argv[0]}: error: " in err


@pytest.mark.parametrize("name, content, needle", [
    ("notes.json", b"# not json", "notes.json: not a JSON trace"),
    ("plain.json.gz", b'{"prompts": []}', "plain.json.gz: not a gzip JSON trace"),
    ("damaged.json.gz", gzip.compress(b'{"prompts": [], "steps": []}', mtime=0)[:10] + b"\xff" * 8,
     "damaged.json.gz: not a gzip JSON trace (Error -3"),  # a bad deflate block: zlib.error
    ("neg.json", b'{"prompts": [{"group_id": 1, "prompt_ids": [3, -2]}], "steps": []}',
     "prompts[0].prompt_ids[1] must be a token id in [0, 2**31), got -2"),
], ids=["not-json", "not-gzip", "damaged-deflate", "negative-token"])
def test_replay_names_what_is_wrong_with_a_trace(capsys, tmp_path, name, content, needle):
    """A file that is not a valid trace is an argument error naming the file and field, not a
    traceback."""
    (tmp_path / name).write_bytes(content)
    assert needle in argument_error(cli.main, ["replay", str(tmp_path / name)], capsys)


def test_cuda_requested_without_a_gpu(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    err = argument_error(cli.main, ["bench", "--device", "cuda:1"], capsys)
    assert "--device cuda:1: no CUDA device is visible here" in err
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    err = argument_error(cli.main, ["bench", "--device", "cuda:1"], capsys)
    assert "--device cuda:1: torch sees 1 CUDA devices here" in err


def test_wandb_requested_without_package(capsys, monkeypatch):
    monkeypatch.setattr("rollout_spec.metrics.wandb_available", lambda: False)
    assert "needs the wandb package" in argument_error(cli.main, ["bench", "--wandb", "offline"], capsys)


@dataclass
class FakeOutput:
    prompt_index: int
    sample_index: int
    token_ids: list
    logprobs: list
    finish_reason: str
    num_verify_steps: int
    num_draft_tokens: int
    num_accepted_tokens: int
    seed: int = 0


class FakeTokenizer:
    """One id per character; decoding maps ids back to characters."""

    chat_template = None
    eos_token_id = 3

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}

    def batch_decode(self, rows, skip_special_tokens=True):
        return ["".join(chr(t) for t in row) for row in rows]


class FakeEngine:
    """Answers every prompt with the right answer to prompt 0 and made-up spec counters."""

    def __init__(self, speculative: bool, answer: str):
        self.speculative, self.answer = speculative, answer
        self.tokenizer, self.calls, self.steps_ended = FakeTokenizer(), [], 0
        self.model = SimpleNamespace(config=SimpleNamespace(vocab_size=256))
        self.num_slots, self.device = 256, "cpu"

    def generate(self, prompts, params, group_ids=None):
        self.calls.append((len(prompts), params, group_ids))
        ids = [ord(c) for c in f"#### {self.answer}"]
        verifies = len(ids) // 2 if self.speculative else len(ids)
        return [FakeOutput(p, i, ids, [0.0] * len(ids), "stop", verifies,
                           2 * verifies if self.speculative else 0, len(ids) - verifies if self.speculative else 0)
                for p in range(len(prompts)) for i in range(params.n)]

    def end_step(self):
        self.steps_ended += 1


def test_bench_loop_with_stand_in_engine(tmp_path, monkeypatch):
    from rollout_spec.workloads import Workload

    answer = Workload("chain_sum", FakeTokenizer(), 2, seed=0).batch(0)[0].answer
    engines = cli.Engines(spec=FakeEngine(True, answer), base=FakeEngine(False, answer))
    monkeypatch.setattr(cli, "open_engines", lambda args: engines)
    argv = ["bench", "--task", "chain_sum", "--steps", "3", "--prompts", "2", "--n", "3",
            "--wandb", "disabled", "--plot", str(tmp_path / "d.png"), "--record",
            str(tmp_path / "t.json.gz"), "--json", str(tmp_path / "r.json")]
    console = Console(record=True, width=160)
    monkeypatch.setattr("rich.console.Console", lambda *a, **k: console)
    assert cli.main(argv) == 0
    rows = json.loads((tmp_path / "r.json").read_text())
    assert [r["step"] for r in rows] == [0, 1, 2]
    length = len(f"#### {answer}")
    assert rows[0]["tpf"] == pytest.approx(length / (length // 2))
    assert rows[0]["accept_rate"] == pytest.approx((length - length // 2) / (2 * (length // 2)))
    assert rows[0]["mean_reward"] == pytest.approx(0.5)  # right for prompt 0 only
    assert engines.spec.steps_ended == 3 and engines.base.steps_ended == 0
    _, params, groups = engines.spec.calls[-1]
    assert groups == [0, 1] and params.seed == 2 and params.n == 3
    assert engines.base.calls[-1][1] == params  # same seeds both ways
    trace = load_trace(tmp_path / "t.json.gz")
    assert len(trace.steps) == 3 and len(trace.steps[0]) == 6
    assert trace.meta["eos_token_id"] == 3 and trace.meta["sampling"]["n"] == 3
    assert (tmp_path / "d.png").read_bytes()[:4] == b"\x89PNG"
    text = console.export_text()
    assert "summary" in text and "step 2" in text
    assert "2 prompts x n=3 = 6 samples per step, at most 256 decoded at once (one synchronous batch)" in text


class FailingEngine(FakeEngine):
    """A FakeEngine whose call number ``fail_at`` (0-based) goes wrong: ``how`` is "request"
    (one request ends in error, as the engine reports a bad prompt) or an exception to raise."""

    def __init__(self, speculative: bool, answer: str, fail_at: int, how: object):
        super().__init__(speculative, answer)
        self.fail_at, self.how = fail_at, how

    def generate(self, prompts, params, group_ids=None):
        outputs = super().generate(prompts, params, group_ids)
        if len(self.calls) - 1 != self.fail_at:
            return outputs
        if self.how != "request":
            raise self.how
        outputs[1].finish_reason = "error"
        return outputs


@pytest.mark.parametrize("how", ["request", RuntimeError("CUDA out of memory"), KeyboardInterrupt()])
def test_a_failed_step_keeps_what_the_steps_before_it_measured(tmp_path, monkeypatch, capsys, how):
    """A step that fails ends the bench, but the finished steps' summary, JSON, trace and plot
    are written first; failed requests are a clear error (status 1), anything else propagates."""
    from rollout_spec.workloads import Workload

    answer = Workload("chain_sum", FakeTokenizer(), 2, seed=0).batch(0)[0].answer
    # Calls: the warm-up, then one per step: call 2 is step 1.
    engines = cli.Engines(spec=FailingEngine(True, answer, fail_at=2, how=how), base=None)
    monkeypatch.setattr(cli, "open_engines", lambda args: engines)
    argv = ["bench", "--task", "chain_sum", "--steps", "3", "--prompts", "2", "--n", "2", "--no-baseline",
            "--wandb", "disabled", "--plot", str(tmp_path / "d.png"), "--record",
            str(tmp_path / "t.json.gz"), "--json", str(tmp_path / "r.json")]
    console = Console(record=True, width=160)
    monkeypatch.setattr("rich.console.Console", lambda *a, **k: console)
    if how == "request":
        assert cli.main(argv) == 1
        assert "step 1: 1 requests failed, e.g. prompt 0" in capsys.readouterr().err
    else:
        with pytest.raises(type(how)):
            cli.main(argv)
    assert [r["step"] for r in json.loads((tmp_path / "r.json").read_text())] == [0]
    assert len(load_trace(tmp_path / "t.json.gz").steps) == 1
    assert (tmp_path / "d.png").read_bytes()[:4] == b"\x89PNG"
    assert "stopped after 1 of 3 RL steps" in console.export_text()


def test_a_stopped_bench_summarises_on_stdout_and_warns_on_stderr(tmp_path, monkeypatch, capsys):
    """``rollout-spec bench > out.md``: the tables land in the file, the warning that the bench
    stopped early and the files written stay on the terminal (stderr)."""
    from rollout_spec.workloads import Workload

    answer = Workload("chain_sum", FakeTokenizer(), 2, seed=0).batch(0)[0].answer
    engines = cli.Engines(spec=FailingEngine(True, answer, fail_at=2, how="request"), base=None)
    monkeypatch.setattr(cli, "open_engines", lambda args: engines)
    assert cli.main(["bench", "--task", "chain_sum", "--steps", "3", "--prompts", "2", "--no-baseline",
                     "--wandb", "disabled", "--json", str(tmp_path / "r.json")]) == 1
    out, err = (" ".join(text.split()) for text in capsys.readouterr())
    assert "samples per step" in out and "step 0 (8 requests)" in out and "summary" in out
    assert "stopped after 1 of 3 RL steps" in err and "figures:" in err and "step 1: 1 requests failed" in err
    assert "stopped" not in out and "figures:" not in out and "summary" not in err


def test_a_bench_failing_in_its_first_step_writes_nothing(tmp_path, monkeypatch, capsys):
    from rollout_spec.workloads import Workload

    answer = Workload("chain_sum", FakeTokenizer(), 2, seed=0).batch(0)[0].answer
    engines = cli.Engines(spec=FailingEngine(True, answer, fail_at=1, how="request"), base=None)
    monkeypatch.setattr(cli, "open_engines", lambda args: engines)
    console = Console(record=True, width=160)
    monkeypatch.setattr("rich.console.Console", lambda *a, **k: console)
    assert cli.main(["bench", "--task", "chain_sum", "--steps", "2", "--prompts", "2", "--no-baseline",
                     "--wandb", "disabled", "--json", str(tmp_path / "r.json")]) == 1
    assert "step 0: 1 requests failed" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists() and "no RL step finished" in console.export_text()


def test_an_output_that_fails_to_write_after_the_run_does_not_lose_the_others(tmp_path, monkeypatch, capsys):
    """The plot fails (say the disk filled) after every step ran: the trace and the JSON are
    still written, the failure names --plot, and the bench ends with status 1, not a traceback."""
    from rollout_spec.workloads import Workload

    answer = Workload("chain_sum", FakeTokenizer(), 2, seed=0).batch(0)[0].answer
    engines = cli.Engines(spec=FakeEngine(True, answer), base=None)
    monkeypatch.setattr(cli, "open_engines", lambda args: engines)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cli, "plot_dashboard", disk_full)
    argv = ["bench", "--task", "chain_sum", "--steps", "2", "--prompts", "2", "--no-baseline",
            "--wandb", "disabled", "--plot", str(tmp_path / "d.png"), "--record",
            str(tmp_path / "t.json.gz"), "--json", str(tmp_path / "r.json")]
    assert cli.main(argv) == 1
    out, err = (" ".join(text.split()) for text in capsys.readouterr())
    assert "summary" in out
    assert f"--plot {tmp_path / 'd.png'}: [Errno 28] No space left on device" in err
    assert "rollout-spec bench: error: results not written: --plot" in err
    assert [r["step"] for r in json.loads((tmp_path / "r.json").read_text())] == [0, 1]
    assert len(load_trace(tmp_path / "t.json.gz").steps) == 2


def test_a_sink_that_fails_to_close_loses_no_file(tmp_path, monkeypatch):
    """wandb's finish ran before the files were written: a sink that raised there lost the JSON
    of a run that had finished every step."""
    from rollout_spec import metrics
    from rollout_spec.workloads import Workload

    class ClosingFails(metrics.NullSink):
        def finish(self) -> None:
            raise RuntimeError("wandb could not close its run")

    answer = Workload("chain_sum", FakeTokenizer(), 2, seed=0).batch(0)[0].answer
    monkeypatch.setattr(cli, "open_engines", lambda args: cli.Engines(spec=FakeEngine(True, answer), base=None))
    monkeypatch.setattr(metrics, "make_sink", lambda *args: ClosingFails())
    argv = ["bench", "--task", "chain_sum", "--steps", "2", "--prompts", "2", "--no-baseline",
            "--wandb", "disabled", "--json", str(tmp_path / "r.json")]
    with pytest.raises(RuntimeError, match="wandb could not close its run"):
        cli.main(argv)
    assert [r["step"] for r in json.loads((tmp_path / "r.json").read_text())] == [0, 1]


def test_drafter_figures_read_stats_and_timer():
    outs = [SimpleNamespace(num_verify_steps=10), SimpleNamespace(num_verify_steps=30)]
    inner = SimpleNamespace(stats=lambda: {"index_tokens": 500, "memory_bytes": 9000},
                            start_batch=lambda ids, prompts, groups: time.sleep(0.01))
    timer = cli.DrafterProbe(inner)
    timer.start_batch([1], [[5]], [None])
    figures = cli.drafter_figures(SimpleNamespace(drafter=timer), outs)
    assert figures["index_tokens"] == 500 and figures["index_bytes"] == 9000
    assert 10_000 / 40 <= figures["us_per_request"] < 1e6 / 40  # >= 10 ms over 40 request steps
    assert timer.take_seconds() == 0.0  # taken once per step
    assert cli.drafter_figures(SimpleNamespace(drafter=None), outs) == {}



@pytest.mark.parametrize("argv,cuda,want", [
    (["--device", "cpu"], True, 8),
    (["--device", "auto"], False, 8),
    (["--device", "auto"], True, 32),
    (["--device", "cuda"], True, 32),
    (["--device", "cuda", "--draft-tokens", "5"], True, 5),
])
def test_draft_tokens_default_follows_the_device(monkeypatch, argv, cuda, want):
    """32 where the batch-aware budget picks each step's size (CUDA), a fixed 8 elsewhere."""
    class Seen(Exception):
        pass

    def open_engines(args):
        raise Seen(args.draft_tokens)

    import torch

    monkeypatch.setattr(cli, "_cuda_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: int(cuda))  # what check_device reads
    monkeypatch.setattr(cli, "open_engines", open_engines)
    with pytest.raises(Seen) as got:
        cli.main(["bench", "--wandb", "disabled", *argv])
    assert got.value.args == (want,)


def test_warm_up_uses_the_steps_sampling_then_starts_the_drafter_empty():
    from rollout_spec.config import SpecConfig
    from rollout_spec.drafter import NgramDrafter

    answer = "7"
    engines = cli.Engines(spec=FakeEngine(True, answer), base=FakeEngine(False, answer))
    old = cli.DrafterProbe(NgramDrafter(SpecConfig(num_draft_tokens=5)))
    old.start_batch([1], [[4, 5, 6]], [None])  # what a warm-up leaves in the index
    engines.spec.drafter = old
    args = cli.build_parser().parse_args(["bench", "--temperature", "0.7", "--top-p", "0.9", "--n", "3",
                                          "--max-new-tokens", "64"])
    cli._warm_up(engines, [1, 2, 3], args)
    for engine in (engines.base, engines.spec):
        (count, params, _), = engine.calls
        assert count == 1 and (params.n, params.temperature, params.top_p) == (3, 0.7, 0.9)
        assert params.max_new_tokens == 16
    fresh = engines.spec.drafter
    assert isinstance(fresh, cli.DrafterProbe) and fresh is not old
    assert fresh.config == old.config and fresh.stats()["index_tokens"] == 0
    assert old.stats()["index_tokens"] == 3


def test_plot_without_matplotlib_is_refused_before_the_bench(capsys, monkeypatch, tmp_path):
    """The dashboards extra is optional: --plot without it fails at once, not after every step."""
    real = cli.importlib.util.find_spec
    monkeypatch.setattr(cli.importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    monkeypatch.setattr(cli, "run_bench", lambda args: pytest.fail("the bench ran"))
    err = argument_error(cli.main, ["bench", "--plot", str(tmp_path / "d.png"), "--wandb", "disabled"], capsys)
    assert "--plot needs matplotlib: pip install 'rollout-spec[dashboards]'" in err


def test_workload_line_says_whether_a_step_queues() -> None:
    """One synchronous batch where every sample has a slot; otherwise how many wait."""
    args = cli.build_parser().parse_args(["bench", "--prompts", "16", "--n", "8", "--max-batch", "32",
                                      "--draft-tokens", "32"])
    queued = cli.workload_line(args, 32, "cuda:0")
    assert queued.startswith("smollm2-135m on cuda:0: 16 prompts x n=8 = 128 samples per step, "
                             "at most 32 decoded at once (the other 96 wait for a slot)")
    assert "one synchronous batch" in cli.workload_line(args, 128, "cuda:0")

"""``bench/engine_bench.py --mode engine``: a CPU smoke run of the table, the prompt history the
drafter has seen before each timed call (cold / warm), a checkpoint's prompts drawn and checked
before any engine is built, and flag errors."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from argument_errors import argument_error, hide_cuda  # noqa: E402
import engine_bench as eb  # noqa: E402
from rollout_spec.engine.engine import RolloutEngine  # noqa: E402
from test_cli_tiny_model import tiny_model_dir  # noqa: E402  (tests/ is on sys.path under pytest)

# 2 layers instead of 30 keep a CPU run to seconds; 3 new tokens, context 16 for the step grid.
TINY = ["--mode", "engine", "--random-weights", "--device", "cpu", "--max-new-tokens", "3",
        "--temperatures", "0.6", "--repeats", "2", "--min-samples", "8", "--ctx", "16",
        "--max-model-len", "256"]


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """Every generate / end_step of the two engines in order, a 'timed' mark before each timed
    call and a 'built' mark once both engines exist: (engine, event, prompts, group ids,
    max_running)."""
    monkeypatch.setitem(eb.SMOLLM2_135M, "num_hidden_layers", 2)
    log: list[tuple] = []
    engines: dict[str, object] = {}
    build, generate, end_step = eb.build_engines, RolloutEngine.generate, RolloutEngine.end_step
    timed = eb.run_generate

    def who(engine: object) -> str:
        return "spec" if engine is engines["spec"] else "base"

    def spy_build(args):
        engines["spec"], engines["base"] = out = build(args)
        log.append(("both", "built", [], (), None))
        return out

    def spy_generate(self, prompts, params, group_ids=None, **kw):
        log.append((who(self), "generate", [tuple(p) for p in prompts], tuple(group_ids), kw.get("max_running")))
        return generate(self, prompts, params, group_ids=group_ids, **kw)

    def spy_end_step(self):
        log.append((who(self), "end_step", [], (), None))
        return end_step(self)

    def spy_timed(engine, prompts, groups, *rest):
        log.append((who(engine), "timed", [tuple(p) for p in prompts], tuple(groups), rest[-1]))
        return timed(engine, prompts, groups, *rest)

    monkeypatch.setattr(eb, "build_engines", spy_build)
    monkeypatch.setattr(RolloutEngine, "generate", spy_generate)
    monkeypatch.setattr(RolloutEngine, "end_step", spy_end_step)
    monkeypatch.setattr(eb, "run_generate", spy_timed)
    return log


def engine_table(out: str) -> list[list[str]]:
    """The cells of the engine table's rows (the section under its '## Engine tokens/s' title)."""
    lines = out[out.index("## Engine tokens/s"):].split("\n\n")[0].splitlines()
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines[3:]]


def run(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    eb.main(argv)
    return capsys.readouterr().out


def test_cold_table_and_prompts_new_to_the_spec_engine(calls: list[tuple], capsys) -> None:
    out = run(TINY + ["--batch-sizes", "1,2"], capsys)
    assert "n=8 samples per prompt at every B" in out and "history=cold" in out
    rows = engine_table(out)
    assert [(r[0], r[1]) for r in rows] == [("0.6", "1"), ("0.6", "2")]
    for r in rows:
        lo, hi = (float(x) for x in r[10].split("-"))
        numbers = [float(x) for x in r[2:10] + r[11:]] + [lo, hi]
        assert all(math.isfinite(x) and x > 0 for x in numbers), r
        assert lo <= hi and r[11] == "16"  # 2 rounds x 1 call x 1 prompt x 8 samples
    seen: set[tuple] = set()
    timed_spec = []
    for i, (eng, event, prompts, groups, running) in enumerate(calls):
        if eng == "spec" and event == "timed":
            timed_spec.append(prompts)
            assert not seen & set(prompts), f"timed call {i} has prompts the spec engine saw before"
            assert calls[i + 1] == ("spec", "generate", prompts, groups, running)
        if eng == "spec" and event == "generate":
            seen |= set(prompts)
    assert [len(p) for p in timed_spec] == [1] * 4  # B=1 and B=2: one prompt a call, 2 rounds each
    timed_base = [c for c in calls if c[:2] == ("base", "timed")]
    assert [c[2] for c in timed_base] == timed_spec  # the plain engine runs the same prompts
    assert [c[4] for c in timed_base] == [1, 1, 2, 2]  # max_running = B


def test_tables_on_stdout_and_status_lines_on_stderr(calls: list[tuple], capsys) -> None:
    """``engine_bench.py > out.md`` keeps the header and the tables; the timings of the run
    itself (engines built, whole run) are status, on stderr."""
    eb.main(TINY + ["--batch-sizes", "1", "--repeats", "1"])
    out, err = capsys.readouterr()
    assert out.startswith("device=cpu ") and len(engine_table(out)) == 1
    assert "engines built in" in err and "whole engine run:" in err
    assert "engines built" not in out and "whole engine run" not in out


def test_warm_history_runs_an_untimed_step_first(calls: list[tuple], capsys) -> None:
    out = run(TINY + ["--batch-sizes", "2", "--history", "warm"], capsys)
    assert "history=warm" in out and len(engine_table(out)) == 1
    spec = [c for c in calls if c[0] == "spec"]
    timed = [i for i, c in enumerate(spec) if c[1] == "timed"]
    assert len(timed) == 2
    for i in timed:
        _, _, prompts, groups, running = spec[i]
        assert spec[i - 2] == ("spec", "generate", prompts, groups, running)  # the untimed step
        assert spec[i - 1][1] == "end_step"
        earlier = [c for c in spec[: i - 2] if c[1] == "generate" and set(c[2]) & set(prompts)]
        assert not earlier, "a warm timed call's prompts were seen before its untimed step"


def test_queue_holds_more_samples_than_run_at_once(calls: list[tuple], capsys) -> None:
    """--queue 2 at B=8: each call has 2 prompts (16 samples) of which 8 run at once."""
    run(TINY + ["--batch-sizes", "8", "--queue", "2", "--repeats", "1"], capsys)
    timed = [c for c in calls if c[1] == "timed"]
    assert [(c[0], len(c[2]), c[4]) for c in timed] == [("base", 2, 8), ("spec", 2, 8)]


def test_budget_decisions_are_counted_per_row_and_round(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """With the batch-aware budget (a CUDA engine's; installed by hand here), every call it
    gets during a row lands in that row's line of the decisions table, by reason, and the
    rounds table splits the row's calls, less the warm-up's, over its rounds."""
    from rollout_spec.engine.budget import CostModel, DraftBudget, budget_from_cost

    monkeypatch.setitem(eb.SMOLLM2_135M, "num_hidden_layers", 2)
    widths = (1, 2, 3, 5, 9, 17, 33)
    grid = CostModel((1, 8), widths, tuple(tuple(1e-3 * (1 + b / 8) * (1 + 0.1 * w) for w in widths)
                                           for b in (1, 8)))
    build, call = eb.build_engines, DraftBudget.__call__
    per_row: list[int] = []

    def with_budget(args):
        out = build(args)
        out[0].draft_budget = budget_from_cost(grid, 8, 32)
        return out

    def counted(self, batch_size):
        per_row[-1] += 1
        return call(self, batch_size)

    def row(*args, **kw):
        per_row.append(0)
        return measure(*args, **kw)

    measure = eb.measure_row
    monkeypatch.setattr(eb, "build_engines", with_budget)
    monkeypatch.setattr(DraftBudget, "__call__", counted)
    monkeypatch.setattr(eb, "measure_row", row)
    out = run(TINY + ["--batch-sizes", "1,2"], capsys)
    lines = out[out.index("## Budget decisions per row"):].split("\n\n")[0].splitlines()
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[3:]]
    assert [c[:2] for c in cells] == [["0.6", "1"], ["0.6", "2"]]
    assert [sum(int(x) for x in c[2:]) for c in cells] == per_row and min(per_row) > 0
    lines = out[out.index("## Rounds: speedup and budget decisions"):].split("\n\n")[0].splitlines()
    rounds = [[c.strip() for c in line.strip("|").split("|")] for line in lines[3:]]
    repeats = int(TINY[TINY.index("--repeats") + 1])
    assert [r[:3] for r in rounds] == [[t, b, str(i + 1)] for t, b in (("0.6", "1"), ("0.6", "2"))
                                       for i in range(repeats)]
    for c in cells:  # a row's rounds hold all of its decisions but the warm-up's
        in_rounds = sum(int(x) for r in rounds if r[:2] == c[:2] for x in r[4:])
        assert 0 < in_rounds < sum(int(x) for x in c[2:])


@pytest.mark.parametrize("flag, value, message", [
    ("--queue", "0", "argument --queue: --queue must be in [1, 64], got 0"),
    ("--batch-sizes", "1,0", "argument --batch-sizes: every --batch-sizes value must be in [1, 4096], got 0"),
    ("--batch-sizes", "eight", "argument --batch-sizes: --batch-sizes must be comma-separated integers"),
    ("--repeats", "0", "argument --repeats: --repeats must be in [1, 1000], got 0"),
    ("--min-samples", "-3", "argument --min-samples: --min-samples must be in [1, 1048576], got -3"),
    ("--repeats", "2.5", "argument --repeats: --repeats must be an integer in [1, 1000], got '2.5'"),
    ("--temperatures", "0.6,nan",
     "argument --temperatures: every --temperatures value must be 0 (greedy) or in [0.01, 100.0], got nan"),
    ("--temperatures", "0.6,1e-9",
     "argument --temperatures: every --temperatures value must be 0 (greedy) or in [0.01, 100.0], got 1e-09"),
    # a negative temperature used to be refused with the range [0.0, 100.0], which holds 0.005
    ("--temperatures", "-1", "every --temperatures value must be 0 (greedy) or in [0.01, 100.0], got -1.0"),
    ("--temperatures", "0.6,hot", "argument --temperatures: --temperatures must be comma-separated numbers"),
    ("--history", "hot", "argument --history: invalid choice: 'hot'"),
    ("--device", "foo", "argument --device: device must be auto, cpu, mps, cuda or cuda:N, got 'foo'"),
])
def test_bad_flags_exit_naming_the_flag(flag: str, value: str, message: str, capsys) -> None:
    assert message in argument_error(eb.main, [flag, value], capsys)


@pytest.fixture
def no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building a model or an engine fails the test: the argument errors below come first."""
    def refuse(*_args, **_kw):
        raise AssertionError("a model was built before the argument error")

    monkeypatch.setattr(eb, "random_model", refuse)
    monkeypatch.setattr(RolloutEngine, "__init__", refuse)
    monkeypatch.setattr(RolloutEngine, "from_pretrained", refuse)


@pytest.mark.parametrize("argv, message", [
    (["--profile", "16", "--batch-sizes", "1"],
     "every --profile value must be in [1, 1] (the largest --batch-sizes value"),
    (["--profile", "2", "--mode", "steps", "--device", "cpu"], "--profile is an engine-mode option"),
    # steps mode sizes its cache to --ctx and --max-new-tokens: the flag was silently ignored there
    (["--mode", "steps", "--device", "cpu", "--max-model-len", "512"],
     "--max-model-len is an engine-mode option (add --mode engine)"),
    (["--random-weights", "--device", "cpu", "--quick", "--max-model-len", "100"],
     "--max-new-tokens 8: prompt length 128 + 8 new tokens exceeds --max-model-len 100"),
    (["--random-weights", "--device", "cpu", "--max-new-tokens", "8", "--max-model-len", "130"],
     "exceeds --max-model-len 130 (raise it to at least 136)"),
    (["--random-weights", "--device", "cpu", "--max-model-len", "9000"],
     "--max-model-len must be in [2, 8192] with --random-weights, got 9000"),
    # the random model has SmolLM2-135M's shapes whatever --model names: the flag was ignored
    (["--random-weights", "--device", "cpu", "--model", "/ckpt/qwen"],
     "--model /ckpt/qwen: --random-weights builds smollm2-135m's shapes and loads no checkpoint"),
    # a repeated value timed its rows twice
    (["--random-weights", "--device", "cpu", "--batch-sizes", "1,8,1"],
     "argument --batch-sizes: --batch-sizes lists 1 more than once"),
    (["--random-weights", "--device", "cpu", "--temperatures", "0.6,1.0,0.60"],
     "argument --temperatures: --temperatures lists 0.6 more than once"),
    (["--random-weights", "--device", "cpu", "--profile", "8,8"], "argument --profile: --profile lists 8 more than once"),
    (["--mode", "steps", "--device", "cpu", "--model", "/ckpt/qwen"],
     "--model /ckpt/qwen: --mode steps times smollm2-135m's shapes with random weights and loads no checkpoint"),
    # the random model ran past its 8192 positions without a word, on a cache sized to match
    (["--mode", "steps", "--device", "cpu", "--ctx", "8184"],
     "--ctx 8184: the step grid's 8184 cached + 9 new tokens exceed the random model's 8192 positions "
     "(--ctx must be at most 8183)"),
    (["--mode", "steps", "--device", "cpu", "--max-new-tokens", "8065"],
     "--max-new-tokens 8065: the decode loops' prompt 128 + 8065 new tokens exceed the random model's 8192 "
     "positions (--max-new-tokens must be at most 8064 in steps mode)"),
    (["--random-weights", "--device", "cpu", "--quick", "--ctx", "8000", "--draft-tokens", "192"],
     "--ctx 8000: the step grid's 8000 cached + 193 new tokens exceed the random model's 8192 positions"),
])
def test_inconsistent_flags_exit_before_any_model(argv: list[str], message: str, no_model, capsys) -> None:
    assert message in argument_error(eb.main, argv, capsys)


def test_triton_backend_without_triton_exits(monkeypatch: pytest.MonkeyPatch, no_model, capsys) -> None:
    monkeypatch.setattr(eb.triton_attention, "is_available", lambda: False)
    err = argument_error(eb.main, ["--verify-backend", "triton", "--device", "cpu"], capsys)
    assert "--verify-backend triton: the triton package is not installed" in err


def test_triton_backend_off_cuda_exits_unless_interpreted(monkeypatch: pytest.MonkeyPatch, no_model,
                                                          capsys) -> None:
    """Triton's kernels need a CUDA device: on the CPU the run built both engines and died in a
    traceback from triton's driver ("0 active drivers"). TRITON_INTERPRET=1 runs them there."""
    monkeypatch.setattr(eb.triton_attention, "is_available", lambda: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    err = argument_error(eb.main, ["--verify-backend", "triton", "--device", "cpu"], capsys)
    assert "--verify-backend triton: the Triton kernels run on CUDA, not on --device cpu" in err
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert eb.parse_args(["--verify-backend", "triton", "--device", "cpu"]).verify_backend == "triton"


@pytest.mark.parametrize("mode", ["engine", "steps"])
def test_cuda_without_a_gpu_exits(mode: str, monkeypatch: pytest.MonkeyPatch, no_model, capsys) -> None:
    hide_cuda(monkeypatch)
    err = argument_error(eb.main, ["--mode", mode, "--device", "cuda"], capsys)
    assert "--device cuda: no CUDA device is visible here" in err


def test_long_checkpoint_prompts_exit_before_timing(capsys) -> None:
    """A checkpoint's prompts are only known once drawn: checked before any timed call."""
    args = eb.parse_args(["--max-new-tokens", "8", "--max-model-len", "100", "--device", "cpu"])
    pool = eb.PromptPool([[1] * 50, [1] * 95])
    err = argument_error(lambda parser: eb.check_prompts(parser, args, pool, [[1] * 20]), eb.build_parser(), capsys)
    assert "longest prompt 95 + 8 new tokens exceeds --max-model-len 100" in err


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama directory with the default model's tokenizer and chat template."""
    return tiny_model_dir(tmp_path_factory.getbasetemp())


CHECKPOINT = ["--device", "cpu", "--batch-sizes", "1", "--temperatures", "0.6", "--repeats", "1",
              "--min-samples", "8", "--max-new-tokens", "3", "--ctx", "16"]


def test_long_checkpoint_prompts_exit_before_any_engine(tiny_checkpoint: Path, no_model, capsys) -> None:
    """The gsm_symbolic prompts are drawn with the checkpoint's tokenizer alone and checked before
    the weights load and the graphs are captured."""
    argv = CHECKPOINT + ["--model", str(tiny_checkpoint), "--max-model-len", "60"]
    err = argument_error(eb.main, argv, capsys)
    assert "--max-new-tokens 3: longest prompt" in err and "exceeds --max-model-len 60" in err


def test_checkpoint_engines_run_the_prompts_checked_before_they_were_built(
        tiny_checkpoint: Path, calls: list[tuple], monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """The prompts are drawn once, before the engines exist, and the timed calls run those."""
    gsm_prompts = eb.gsm_prompts

    def spy_draw(tokenizer, count):
        drawn = gsm_prompts(tokenizer, count)
        calls.append(("none", "drawn", [tuple(p) for p in drawn], (), None))
        return drawn

    monkeypatch.setattr(eb, "gsm_prompts", spy_draw)
    out = run(CHECKPOINT + ["--model", str(tiny_checkpoint), "--max-model-len", "256"], capsys)
    assert "gsm_symbolic chat prompts" in out and len(engine_table(out)) == 1
    assert [c[1] for c in calls[:2]] == ["drawn", "built"] and [c[1] for c in calls].count("drawn") == 1
    timed = [p for c in calls if c[1] == "timed" for p in c[2]]
    assert timed and set(timed) <= set(calls[0][2])


def test_checkpoint_without_a_tokenizer_exits(tmp_path: Path, no_model, capsys) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")  # a checkpoint folder, as --model checks
    err = argument_error(eb.main, CHECKPOINT + ["--model", str(tmp_path)], capsys)
    assert f"--model {tmp_path}: {tmp_path} has no tokenizer (tokenizer.json or tokenizer_config.json)" in err


def test_unknown_model_exits(no_model, capsys) -> None:
    err = argument_error(eb.main, CHECKPOINT + ["--model", "no-such-model"], capsys)
    assert "--model no-such-model: model must be one of ['smollm2-135m']" in err

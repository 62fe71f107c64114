"""``rollout-spec replay``: drafters compared lock-step on a trace that bench's recorder wrote."""
from __future__ import annotations

from rollout_spec import cli
from test_cli import FakeTokenizer  # noqa: E402  (tests/ is on sys.path under pytest)


def test_replay_compares_drafters_on_a_recorded_trace(tmp_path, capsys):
    from rollout_spec.workloads import TraceRecorder, Workload

    prompts = Workload("chain_sum", FakeTokenizer(), 2, seed=0).batch(0)
    answer = [ord(c) for c in "so the sum is 12 and the sum is 12 so the sum is 12"]
    rec = TraceRecorder("fake", {"n": 2}, eos_token_id=3)
    for _ in range(2):  # the same answers twice: step 1 is drafted from step 0's history
        rec.add_step(prompts, [(0, answer), (0, answer), (1, answer[::-1]), (1, answer[::-1])])
    path = rec.save(tmp_path / "t.json.gz")
    assert cli.main(["replay", str(path), "--draft-tokens", "4"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.count("│") > 5}
    assert {"rollout-spec", "prompt-lookup"} <= set(rows)
    ours = [float(x) for x in rows["rollout-spec"].split("│")[2:4]]
    assert ours[1] > ours[0] >= 1.0  # history from step 0 makes step 1 cheaper
    assert ours[1] <= 5.0  # at most budget + 1 tokens per forward
    assert "noise keys" not in out  # the recording has no seeds


def test_replay_shows_which_drafter_it_is_replaying_on_stderr(tmp_path, capsys, monkeypatch):
    """One step of a shared trace took 25 s to replay on a 2-core CPU with nothing printed until
    the table; a spinner on stderr names the drafter, the table stays alone on stdout."""
    import re

    monkeypatch.setenv("FORCE_COLOR", "1")  # the consoles draw as on a terminal: the spinner shows
    path = _empty_step_trace(tmp_path, [True, True])
    assert cli.main(["replay", str(path), "--draft-tokens", "2"]) == 0
    out, err = (re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text) for text in capsys.readouterr())
    assert "replaying 2 steps with rollout-spec" in err and "replaying 2 steps with prompt-lookup" in err
    assert "replaying" not in out and "lock-step replay" in out


def test_replay_of_a_keyed_recording_says_it_tells_the_keys(tmp_path, capsys):
    from rollout_spec.workloads import TraceRecorder, Workload

    prompts = Workload("chain_sum", FakeTokenizer(), 1, seed=0).batch(0)
    rec = TraceRecorder("fake", {"n": 2, "temperature": 1.0}, eos_token_id=3, vocab_size=128)
    rec.add_step(prompts, [(0, [40, 41, 42]), (0, [40, 41, 43])], seeds=[5, 6])
    path = rec.save(tmp_path / "t.json")
    assert cli.main(["replay", str(path), "--draft-tokens", "2"]) == 0
    assert "our drafter told the recorded noise keys" in " ".join(capsys.readouterr().out.split())


def _empty_step_trace(tmp_path, steps_with_tokens: list[bool]):
    """A recording whose steps hold two responses each, empty where ``steps_with_tokens`` says."""
    from rollout_spec.workloads import TraceRecorder, Workload

    prompts = Workload("chain_sum", FakeTokenizer(), 1, seed=0).batch(0)
    rec = TraceRecorder("fake", {"n": 2}, eos_token_id=3)
    for has_tokens in steps_with_tokens:
        ids = [40, 41, 42] if has_tokens else []
        rec.add_step(prompts, [(0, ids), (0, list(ids))])
    return rec.save(tmp_path / "t.json")


def test_replay_of_a_step_of_empty_responses_shows_no_tpf_and_names_it(tmp_path, capsys):
    """A step whose responses are all empty takes no verify step: its TPF is "-", not 0.00, and
    a note on stderr names the steps (the other steps still have figures to show)."""
    path = _empty_step_trace(tmp_path, [True, False, True, False])
    assert cli.main(["replay", str(path), "--draft-tokens", "2"]) == 0
    out, err = capsys.readouterr()
    rows = [line.split("│") for line in out.splitlines() if line.count("│") > 5]
    assert rows and all(float(r[2]) >= 1.0 and r[3].strip() == "-" for r in rows)
    assert f"NOTE: {path}: every response of steps 1, 3 is empty; no figures for them (shown as -)" in err


def test_replay_of_a_trace_of_empty_responses_is_an_argument_error(tmp_path, capsys):
    from argument_errors import argument_error

    path = _empty_step_trace(tmp_path, [False, False])
    err = argument_error(cli.main, ["replay", str(path)], capsys)
    assert f"TRACE.json {path}: every response is empty (no tokens to replay)" in err


def test_max_steps_past_the_trace_is_an_argument_error(tmp_path, capsys):
    """It replayed the steps there were, silently; the bench scripts' --steps refuses, so does this."""
    from argument_errors import argument_error

    path = _empty_step_trace(tmp_path, [True, True])
    err = argument_error(cli.main, ["replay", str(path), "--max-steps", "3"], capsys)
    assert f"--max-steps 3: trace {path} has only 2 steps" in err
    assert cli.main(["replay", str(path), "--max-steps", "2"]) == 0


def test_replay_of_a_trace_without_responses_is_an_argument_error(tmp_path, capsys):
    """A trace with no steps, or a step with no responses, has nothing to replay: an error naming
    the file (it printed a table without figures and exited 0), as the bench scripts say."""
    import pytest

    from rollout_spec.replay import Trace, save_trace

    for steps in ([], [[]]):
        path = tmp_path / f"t{len(steps)}.json"
        save_trace(Trace(prompts={0: [1, 2, 3]}, steps=steps), path)
        with pytest.raises(SystemExit) as exc:
            cli.main(["replay", str(path)])
        assert exc.value.code == 2
        assert f"{path}: every step must hold responses (it has {len(steps)} steps)" in capsys.readouterr().err

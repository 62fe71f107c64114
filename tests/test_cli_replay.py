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


def test_replay_of_a_keyed_recording_says_it_tells_the_keys(tmp_path, capsys):
    from rollout_spec.workloads import TraceRecorder, Workload

    prompts = Workload("chain_sum", FakeTokenizer(), 1, seed=0).batch(0)
    rec = TraceRecorder("fake", {"n": 2, "temperature": 1.0}, eos_token_id=3, vocab_size=128)
    rec.add_step(prompts, [(0, [40, 41, 42]), (0, [40, 41, 43])], seeds=[5, 6])
    path = rec.save(tmp_path / "t.json")
    assert cli.main(["replay", str(path), "--draft-tokens", "2"]) == 0
    assert "our drafter told the recorded noise keys" in " ".join(capsys.readouterr().out.split())


def test_replay_of_a_step_of_empty_responses_shows_no_tpf(tmp_path, capsys):
    """A step whose responses are all empty takes no verify step: its TPF is "-", not 0.00."""
    from rollout_spec.workloads import TraceRecorder, Workload

    prompts = Workload("chain_sum", FakeTokenizer(), 1, seed=0).batch(0)
    rec = TraceRecorder("fake", {"n": 2}, eos_token_id=3)
    rec.add_step(prompts, [(0, [40, 41, 42]), (0, [40, 41, 42])])
    rec.add_step(prompts, [(0, []), (0, [])])
    path = rec.save(tmp_path / "t.json")
    assert cli.main(["replay", str(path), "--draft-tokens", "2"]) == 0
    rows = [line.split("│") for line in capsys.readouterr().out.splitlines() if line.count("│") > 5]
    assert rows and all(float(r[2]) >= 1.0 and r[3].strip() == "-" for r in rows)


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

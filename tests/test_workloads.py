"""Workload prompts, the tasks' own reward checkers, and trace recording."""
from __future__ import annotations

import gzip
import json

import pytest

from rollout_spec import workloads
from rollout_spec.replay import load_trace
from rollout_spec.workloads import TraceRecorder, Workload, extract_code, extract_final_answer


class CharTokenizer:
    """A stand-in tokenizer: one id per character, a trivial chat template."""

    chat_template = "user: {content}"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert not tokenize and add_generation_prompt
        return f"<u>{messages[0]['content']}<a>"

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) % 50000 for c in text]}


def test_math_prompts_are_templated_and_scored_by_the_task():
    wl = Workload("basic_arithmetic", CharTokenizer(), num_prompts=3, seed=7)
    prompts = wl.batch(0)
    assert [p.group_id for p in prompts] == [0, 1, 2]
    p = prompts[0]
    assert p.text.endswith(workloads.MATH_INSTRUCTION)
    assert "".join(chr(t) for t in p.prompt_ids) == f"<u>{p.text}<a>"
    assert wl.score(p, f"so the answer is\n#### {p.answer}") == 1.0
    assert wl.score(p, "#### 123456789") == 0.0
    assert wl.score(p, "no marker at all") == 0.0
    assert wl.batch(1) == prompts  # same pool every step by default


def test_fresh_prompts_each_step():
    wl = Workload("basic_arithmetic", CharTokenizer(), num_prompts=2, seed=1, fresh_each_step=True,
                  max_steps=2)
    assert [p.group_id for p in wl.batch(1)] == [2, 3]
    with pytest.raises(ValueError, match="step must be"):
        wl.batch(2)


def test_bad_workload_arguments():
    with pytest.raises(ValueError, match="task must be"):
        Workload("no_such_task", CharTokenizer(), 2)
    with pytest.raises(ValueError, match=r"num_prompts must be in \[1"):
        Workload("chain_sum", CharTokenizer(), 0)


@pytest.mark.parametrize("kwargs, count", [({"num_prompts": 4}, 4),
                                           ({"num_prompts": 2, "fresh_each_step": True, "max_steps": 2}, 4)])
def test_a_humaneval_pool_beyond_its_problems_is_refused(monkeypatch, kwargs, count):
    """HumanEval has a fixed number of problems (3 here, monkeypatched): a pool larger than that is
    refused naming the fields that size it and the allowed range, not silently cut short."""
    problems = [{"task_id": f"HumanEval/{i}", "prompt": "def f():\n"} for i in range(3)]
    monkeypatch.setattr(workloads, "_humaneval_problems", lambda: problems)
    with pytest.raises(ValueError, match=rf"num_prompts \(times max_steps with fresh_each_step\) must be in "
                                         rf"\[1, 3\] for humaneval's 3 problems, got {count}$"):
        Workload(workloads.HUMANEVAL, CharTokenizer(), **kwargs)
    assert len(Workload(workloads.HUMANEVAL, CharTokenizer(), num_prompts=3).prompts) == 3


def test_humaneval_reward_runs_the_tests():
    wl = Workload(workloads.HUMANEVAL, CharTokenizer(), num_prompts=1)
    p = wl.batch(0)[0]
    assert p.kind == "code" and p.source == "HumanEval/0" and p.answer is None
    good = "```python\n" + p.entry["prompt"] + p.entry["canonical_solution"] + "```"
    bad = "```python\ndef has_close_elements(numbers, threshold):\n    return False\n```"
    assert wl.score_many([p, p], [good, bad]) == [1.0, 0.0]
    assert wl.score(p, p.entry["canonical_solution"]) == 1.0  # a bare indented body also runs


def test_an_answer_the_checker_cannot_parse_scores_zero():
    """prime_factorization's checker raises ValueError on "2 x 3" and "nan": a wrong answer."""
    wl = Workload("prime_factorization", CharTokenizer(), num_prompts=1)
    p = wl.batch(0)[0]
    assert wl.score_many([p, p, p], ["#### nan", "#### 2 x 3", f"#### {p.answer}"]) == [0.0, 0.0, 1.0]


def test_a_prompt_of_another_task_is_refused_not_scored_zero():
    """Before, a HumanEval workload scored a math prompt 0.0 (its checker's AttributeError was
    swallowed as a wrong answer), and a prompt of another reasoning-gym task went to this task's
    checker."""
    math = Workload("basic_arithmetic", CharTokenizer(), num_prompts=1).batch(0)[0]
    code = Workload(workloads.HUMANEVAL, CharTokenizer(), num_prompts=1)
    other = Workload("chain_sum", CharTokenizer(), num_prompts=1)
    with pytest.raises(ValueError, match=r"task 'humaneval''s, got a math prompt of 'basic_arithmetic'"):
        code.score(math, f"#### {math.answer}")
    with pytest.raises(ValueError, match=r"task 'chain_sum''s, got a math prompt of 'basic_arithmetic'"):
        other.score_many([math], [f"#### {math.answer}"])
    with pytest.raises(ValueError, match=r"got a code prompt of 'HumanEval/0'"):
        other.score(code.batch(0)[0], "#### 1")
    with pytest.raises(TypeError, match="prompt must be a Prompt, got str"):
        other.score("What is 1 + 1?", "#### 2")


def test_answer_and_code_extraction():
    assert extract_final_answer("a\n#### 4\n#### 42.") == "42"
    assert extract_final_answer("####   ") is None
    assert extract_final_answer("#### 12 #### 13") == "13"  # the last marker's, not the line's rest
    assert extract_final_answer("#### 42 ####") == "42"  # a bare trailing marker has no answer
    assert extract_final_answer("##### 42") == "42"
    assert extract_final_answer("####\r\n7\r\n") == "7"
    assert extract_final_answer("########") is None
    assert extract_code("text\n```py\nx = 1\n```\nmore") == "x = 1\n"
    for fence in ("```Python\n", "```python3\n", "```python\r\n", "``` python\n", "```\n"):
        assert extract_code(f"Here:\n{fence}x = 1\n```") == "x = 1\n", fence
    assert extract_code("plain") == "plain"
    # a block in another language is skipped whole: its closing fence opens nothing
    for other in ("```text\nIt keeps the fraction.\n```\n", "```pycon\n>>> f(3.5)\n0.5\n```\n",
                  "```bash\npip install x\n```\nThen:\n"):
        assert extract_code(other + "```python\nx = 1\n```") == "x = 1\n", other
    assert extract_code("```text\nonly prose\n```") == "```text\nonly prose\n```"
    # ``` inside a line of prose opens no block
    assert extract_code("Wrap it in ``` fences:\n```python\nx = 1\n```") == "x = 1\n"
    assert extract_code("  ```python\nx = 1\n```") == "x = 1\n"  # an indented fence still opens one


def test_trace_round_trip_in_shared_format(tmp_path):
    wl = Workload("chain_sum", CharTokenizer(), num_prompts=2, seed=3)
    prompts = wl.batch(0)
    rec = TraceRecorder("tiny", {"temperature": 1.0, "n": 2}, eos_token_id=2)
    rec.add_step(prompts, [(0, [5, 6, 2]), (1, [7]), (1, [8, 2])])
    rec.add_step(prompts, [(0, [9])])
    path = rec.save(tmp_path / "sub" / "t.json.gz")
    data = json.loads(gzip.decompress(path.read_bytes()))
    assert set(data) == {"model", "sampling", "eos_token_id", "prompts", "steps"}
    assert data["prompts"][1]["prompt_ids"] == list(prompts[1].prompt_ids)
    assert data["prompts"][0]["kind"] == "math" and data["prompts"][0]["answer"] == prompts[0].answer
    assert data["prompts"][0]["text"] == prompts[0].text and data["eos_token_id"] == 2
    assert data["steps"][0][2] == {"group_id": 1, "response_ids": [8, 2]}
    trace = load_trace(rec.save(tmp_path / "t.json"))
    assert trace.steps[1] == [(0, [9])] and trace.prompts[1] == list(prompts[1].prompt_ids)
    with pytest.raises(ValueError, match="prompt index"):
        rec.add_step(prompts, [(5, [1])])
    assert trace.seeds is None  # nothing recorded them


def test_trace_recorder_refuses_one_group_id_for_two_prompts(tmp_path):
    """Two workloads both number their prompts from 0: recording both would file the second's
    responses under the first's prompt. The step is refused and the recording left as it was."""
    first = Workload("chain_sum", CharTokenizer(), num_prompts=1, seed=3).batch(0)
    other = Workload("basic_arithmetic", CharTokenizer(), num_prompts=1, seed=3).batch(0)
    assert first[0].group_id == other[0].group_id and first[0].prompt_ids != other[0].prompt_ids
    rec = TraceRecorder("tiny", {"temperature": 1.0}, eos_token_id=2)
    rec.add_step(first, [(0, [5])])
    with pytest.raises(ValueError, match=r"prompts\[0\].group_id 0 was recorded with other prompt ids"):
        rec.add_step(other, [(0, [7])])
    rec.add_step(first, [(0, [9])])  # the same prompt again is a later step of its group
    trace = load_trace(rec.save(tmp_path / "t.json"))
    assert trace.prompts == {0: list(first[0].prompt_ids)} and trace.steps == [[(0, [5])], [(0, [9])]]


def test_trace_recorder_names_a_bad_model_and_responses_without_prompts():
    with pytest.raises(TypeError, match="model must be the model's name \\(a str\\), got int"):
        TraceRecorder(7, {"temperature": 1.0}, eos_token_id=2)
    rec = TraceRecorder("tiny", {"temperature": 1.0}, eos_token_id=2)
    with pytest.raises(ValueError, match="prompts is empty, so responses"):  # was: "in [0, -1]"
        rec.add_step([], [(0, [5])])
    rec.add_step([], [])  # an empty step is still a step


def test_trace_recorder_keeps_the_samples_seeds(tmp_path):
    """With the seeds and the vocabulary, a replay can tell the drafter the samples' noise keys."""
    prompts = Workload("basic_arithmetic", CharTokenizer(), 2, seed=0).batch(0)
    rec = TraceRecorder("tiny", {"temperature": 0.8}, eos_token_id=2, vocab_size=300)
    rec.add_step(prompts, [(0, [5, 6, 2]), (1, [7])], seeds=[17, 2**62])
    trace = load_trace(rec.save(tmp_path / "t.json"))
    assert trace.seeds == [[17, 2**62]] and trace.noise_keys(0) == ([17, 2**62], 0.8, 300)
    with pytest.raises(ValueError, match=r"seeds must have one entry per response \(2\), got 1"):
        rec.add_step(prompts, [(0, [5]), (1, [7])], seeds=[3])
    with pytest.raises(ValueError, match=r"seeds\[0\] must be in \[0, 9223372036854775807\], "
                                         r"got -1"):
        rec.add_step(prompts, [(0, [5])], seeds=[-1])

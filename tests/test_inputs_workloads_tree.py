"""Bad input to workloads, group ids and DraftBatch: a TypeError/ValueError naming the field,
raised before any state changes, and nothing truncated, wrapped or read from strings."""
from __future__ import annotations

import numpy as np
import pytest

from rollout_spec.groups import prompt_group_id, text_group_id
from rollout_spec.tree import DraftBatch
from rollout_spec.workloads import (Prompt, TraceRecorder, Workload, chat_prompt_ids,
                                    extract_code, extract_final_answer)

PROMPTS = [Prompt(7, "math", "x", "q", (1, 2), "3"), Prompt(9, "math", "x", "q2", (3, 4), "4")]
TOKEN_RANGE = r"\[0, 2147483647\]"


class ListTokenizer:
    """No chat template; returns whatever ids it was given."""

    chat_template = None

    def __init__(self, ids=(1, 2, 3)):
        self.ids = list(ids)

    def __call__(self, text, **kwargs):
        return {"input_ids": self.ids}


# --- TraceRecorder ----------------------------------------------------------------------------

@pytest.mark.parametrize("responses, seeds, error, message", [
    ([(0, [1, 2])], [-1], ValueError, r"seeds\[0\] must be in \[0"),
    ([(0, [1]), (1, [2])], [4, 2.5], TypeError, r"seeds\[1\] must be an integer in \[0"),
    ([(0, [1]), (5, [1, 2])], None, ValueError,
     r"responses\[1\]\[0\] \(prompt index\) must be in \[0, 1\]"),
    ([(0, [1]), (1, [-5])], None, ValueError, r"responses\[1\] token_ids .*" + TOKEN_RANGE),
    ([(0, [1]), [1, 2, 3]], None, ValueError, r"responses\[1\] must be a \(prompt index"),
])
def test_rejected_step_records_nothing(responses, seeds, error, message):
    rec = TraceRecorder("m", {}, 2)
    with pytest.raises(error, match=message):
        rec.add_step(PROMPTS, responses, seeds=seeds)
    assert rec._steps == [] and rec._seeds == [] and rec._prompts == {}
    rec.add_step(PROMPTS, [(1, [4])], seeds=[3])  # still consistent afterwards
    assert rec.to_trace().steps == [[(9, [4])]] and rec.to_trace().seeds == [[3]]


@pytest.mark.parametrize("ids, error", [
    ("12", TypeError), ([1.7, 2.2], TypeError), ([True], TypeError),
    ([-5], ValueError), ([2**40], ValueError), ([[1, 2]], TypeError),
])
def test_response_token_ids_are_not_coerced(ids, error):
    rec = TraceRecorder("m", {}, 2)
    with pytest.raises(error, match="token_ids"):
        rec.add_step(PROMPTS, [(0, ids)])
    assert rec._steps == []


def test_response_token_ids_are_stored_as_ints():
    rec = TraceRecorder("m", {}, 2)
    rec.add_step(PROMPTS, [(0, np.array([5, 2**31 - 1], np.int64)), (1, [])])
    assert rec._steps == [[(7, [5, 2**31 - 1]), (9, [])]]
    assert all(type(t) is int for t in rec._steps[0][0][1])


@pytest.mark.parametrize("eos, vocab, error, message", [
    (2.5, None, TypeError, "eos_token_id must be an integer"),
    ("2", None, TypeError, "eos_token_id must be an integer"),
    (True, None, TypeError, "eos_token_id must be an integer"),
    (-5, None, ValueError, r"eos_token_id must be in \[0, 2147483647\]"),
    (100, 10, ValueError, r"eos_token_id must be in \[0, 9\]"),
])
def test_eos_token_id_is_checked(eos, vocab, error, message):
    with pytest.raises(error, match=message):
        TraceRecorder("m", {}, eos, vocab_size=vocab)


def test_eos_token_id_may_be_absent_or_a_numpy_int():
    assert TraceRecorder("m", {}, None).meta["eos_token_id"] is None
    eos = TraceRecorder("m", {}, np.int64(2), vocab_size=3).meta["eos_token_id"]
    assert eos == 2 and type(eos) is int


@pytest.mark.parametrize("prompt, error, message", [
    (Prompt(-1, "math", "x", "q", (1, 2), "3"), ValueError, r"prompts\[0\].group_id must be in \[0, 2147483647\]"),
    (Prompt(2**31, "math", "x", "q", (1, 2), "3"), ValueError, r"prompts\[0\].group_id must be in"),
    (Prompt(3, "math", "x", "q", (-7, 2), "3"), ValueError, r"prompts\[0\].prompt_ids .*" + TOKEN_RANGE),
    (Prompt(3, "math", "x", "q", (1, 2.5), "3"), TypeError, r"prompts\[0\].prompt_ids"),
    ({"group_id": 3, "prompt_ids": [1, 2]}, TypeError, r"^prompts\[0\] must be a Prompt, got dict$"),
    ((3, "math", "x", "q", (1, 2), "3"), TypeError, r"^prompts\[0\] must be a Prompt, got tuple$"),
])
def test_prompts_outside_the_trace_format_are_refused(prompt, error, message):
    """What ``load_trace`` would refuse is refused when recorded, not after the run at save."""
    rec = TraceRecorder("m", {}, 2)
    with pytest.raises(error, match=message):
        rec.add_step([prompt], [(0, [5])])
    assert rec._steps == [] and rec._prompts == {}


def test_numpy_prompts_are_recorded_as_plain_ints_and_load_back(tmp_path):
    from rollout_spec.replay import load_trace

    rec = TraceRecorder("m", {"temperature": np.float32(0.5)}, 2)
    rec.add_step([Prompt(np.int64(3), "math", "x", "q", (np.int64(1), 2), "3")], [(0, [5])])
    trace = load_trace(rec.save(tmp_path / "t.json"))
    assert trace.prompts == {3: [1, 2]} and trace.steps == [[(3, [5])]]
    assert trace.meta["sampling"]["temperature"] == 0.5


@pytest.mark.parametrize("sampling, error", [
    ({"temperature": "0.7"}, TypeError), ({"temperature": -1.0}, ValueError), ([("temperature", 1.0)], TypeError),
    ({"temperature": 0.6, "top_p": np.float32(0.9)}, TypeError),  # would not serialise at save
    ({"max_new_tokens": "384"}, TypeError), ({"max_new_tokens": 0}, ValueError),  # load_trace refuses them
])
def test_sampling_a_replay_could_not_read_is_refused(sampling, error):
    with pytest.raises(error, match="sampling"):
        TraceRecorder("m", sampling, 2)


# --- prompt_group_id --------------------------------------------------------------------------

@pytest.mark.parametrize("ids, error", [
    ([1.5, 2.7], TypeError), (np.array([1.0, 2.0]), TypeError), ([True, False], TypeError),
    ("12", TypeError), (5, TypeError), (None, TypeError), ([[1, 2]], TypeError),
    (np.array([[1, 2]]), TypeError), ([-1], ValueError), ([2**31], ValueError),
    (np.array([2**32 + 1]), ValueError),
])
def test_prompt_group_id_needs_1d_token_ids(ids, error):
    with pytest.raises(error, match="prompt_ids"):
        prompt_group_id(ids)


@pytest.mark.parametrize("uid", [b"uid-1", 7, None])
def test_text_group_id_refuses_what_is_not_text(uid):
    """A bytes uid gave an AttributeError about ``encode``, not what was wrong."""
    with pytest.raises(TypeError, match=rf"^text must be a str, got {type(uid).__name__}$"):
        text_group_id(uid)


def test_prompt_group_id_is_unchanged_for_valid_prompts():
    """Pinned: the id is shared by traces, checkpoints and replicas, so it must never change."""
    assert prompt_group_id([1, 2, 3]) == 1951833302 and prompt_group_id([0]) == 791643214
    want = prompt_group_id([1, 2, 2**31 - 1])
    assert prompt_group_id((1, 2, 2**31 - 1)) == want
    assert prompt_group_id(np.array([1, 2, 2**31 - 1], np.int64)) == want
    assert prompt_group_id(np.array([0, 1, 2, 2**31 - 1], np.int32)[1:]) == want
    assert prompt_group_id(np.array([1, 9, 2, 9, 2**31 - 1], np.uint32)[::2]) == want
    assert prompt_group_id([]) == prompt_group_id(np.zeros(0, np.int32))


# --- DraftBatch -------------------------------------------------------------------------------

@pytest.mark.parametrize("trees, error, message", [
    ([[(5.7, -1)]], TypeError, "tokens"),
    ([[("5", -1)]], TypeError, "tokens"),
    ([[(True, -1)]], TypeError, "tokens"),
    ([[(5, -1), (6, 0.9)]], TypeError, "parents"),
    ([[(2**31, -1)]], ValueError, "tokens must hold token ids in " + TOKEN_RANGE),
    ([[(np.int64(2**33), -1)]], ValueError, "tokens must hold token ids in " + TOKEN_RANGE),
    ([[(5, -(2**32) + 1)]], ValueError, "parents"),  # would wrap to 1 as int32
    ([[(5, 2**32)]], ValueError, "parents"),  # would wrap to 0 as int32
    ([[(5, -1, 0.3)]], ValueError, r"\(token, parent\) pairs"),
    ([[5]], ValueError, r"\(token, parent\) pairs"),
    ([5], ValueError, r"\(token, parent\) pairs"),
    (None, TypeError, "trees must be a list"),
    ("ab", TypeError, "trees must be a list"),
    ([[(5, -1)], {(6, -1), (7, 0)}], TypeError, r"trees\[1\] must be a list .* in node order, got set"),
    ([{5: -1}], TypeError, r"trees\[0\] must be a list .* in node order, got dict"),
])
def test_from_lists_rejects_bad_nodes(trees, error, message):
    with pytest.raises(error, match=message):
        DraftBatch.from_lists(trees)


@pytest.mark.parametrize("probs, error", [
    ([[0.5, 0.4], [0.3]], ValueError),  # same total, wrong trees
    ([[0.5, 0.4, 0.3]], ValueError),  # fewer requests than trees, same total
    ([[0.5], [0.4, 0.3], []], ValueError),
    ([[0.5], [0.4, float("nan")]], ValueError),
    ([[0.5], [0.4, -0.1]], ValueError),
    ([[0.5], [0.4, float("inf")]], ValueError),
    ([[0.5], [0.4, 1e300]], ValueError),
    ([[0.5], [0.4, 1.5]], ValueError),
    ([["0.5"], [0.4, 0.3]], TypeError),
    ([[True], [False, True]], TypeError),
    ([[True], [0.4, 0.3]], TypeError),  # one bool among numbers was read as 1.0
    ([[0.5], [np.False_, 0.3]], TypeError),
    ([[None], [0.4, 0.3]], TypeError),
    ([[[0.5, 0.6]], [0.4, 0.3]], TypeError),  # a nested list where a number belongs
    (5, ValueError),
])
def test_from_lists_checks_probs_per_tree_and_range(probs, error):
    with pytest.raises(error, match="probs"):
        DraftBatch.from_lists([[(5, -1)], [(6, -1), (7, 0)]], probs=probs)


def test_from_lists_keeps_valid_probs_and_integer_types():
    b = DraftBatch.from_lists([[(np.int64(5), -1)], [(np.uint16(6), np.int32(-1)), (7, 0)]],
                              probs=[[1], [0.0, 0.25]])
    assert b.tokens.tolist() == [5, 6, 7] and b.parents.tolist() == [-1, -1, 0]
    assert b.probs.tolist() == [1.0, 0.0, 0.25] and b.probs.dtype == np.float32


def _direct(probs: np.ndarray) -> DraftBatch:
    return DraftBatch(np.array([0, 1], np.int32), np.array([5], np.int32),
                      np.array([-1], np.int32), probs)


@pytest.mark.parametrize("probs, message", [
    (np.array([[1.0]], np.float32), "1-D float32"),
    (np.array([np.nan], np.float32), r"\[0, 1\]"),
    (np.array([-1.0], np.float32), r"\[0, 1\]"),
    (np.array([np.inf], np.float32), r"\[0, 1\]"),
])
def test_validate_checks_probs_shape_and_range(probs, message):
    with pytest.raises(ValueError, match=message):
        _direct(probs).validate()


@pytest.mark.parametrize("num, error", [(-1, ValueError), (True, TypeError), (2.0, TypeError),
                                        ("3", TypeError), (2**62, ValueError)])
def test_empty_checks_num_requests(num, error):
    with pytest.raises(error, match="num_requests"):
        DraftBatch.empty(num)


def test_empty_accepts_numpy_ints():
    assert DraftBatch.empty(np.int64(3)).num_requests == 3


# --- Workload ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, message", [
    ({"seed": 1.5}, TypeError, "seed must be an integer"),
    ({"seed": -1}, ValueError, r"seed must be in \[0"),
    ({"seed": None}, TypeError, "seed must be an integer"),
    ({"fresh_each_step": "no"}, TypeError, "fresh_each_step must be a bool"),
    ({"fresh_each_step": 1}, TypeError, "fresh_each_step must be a bool"),
])
def test_workload_arguments_are_checked(kwargs, error, message):
    with pytest.raises(error, match=message):
        Workload("basic_arithmetic", ListTokenizer(), 2, **kwargs)


@pytest.fixture(scope="module")
def fresh_workload() -> Workload:
    return Workload("basic_arithmetic", ListTokenizer(), 2, fresh_each_step=True, max_steps=3)


@pytest.mark.parametrize("step, error, message", [
    (-1, ValueError, r"step must be in \[0, 2\], got -1"),
    (-2, ValueError, r"step must be in \[0, 2\], got -2"),
    (3, ValueError, r"step must be in \[0, 2\], got 3"),
    (1.5, TypeError, "step must be an integer"),
    (True, TypeError, "step must be an integer"),
])
def test_fresh_batch_step_is_checked(fresh_workload, step, error, message):
    with pytest.raises(error, match=message):
        fresh_workload.batch(step)


def test_fresh_batch_steps_in_range(fresh_workload):
    assert [p.group_id for p in fresh_workload.batch(2)] == [4, 5]
    assert [p.group_id for p in fresh_workload.batch(np.int64(1))] == [2, 3]


def test_pool_batch_step_is_checked():
    wl = Workload("basic_arithmetic", ListTokenizer(), 2)
    assert wl.batch(10) == wl.prompts  # any later step reuses the pool
    with pytest.raises(ValueError, match=r"step must be in \[0, inf\]"):
        wl.batch(-7)


def test_responses_must_be_text():
    wl = Workload("basic_arithmetic", ListTokenizer(), 2)
    p = wl.batch(0)[0]
    for call in (lambda: extract_final_answer(None), lambda: extract_final_answer(b"#### 3"),
                 lambda: extract_code(None), lambda: wl.score(p, None)):
        with pytest.raises(TypeError, match="response must be a str"):
            call()
    with pytest.raises(TypeError, match="responses must be a sequence of str"):
        wl.score_many(wl.batch(0), "ab")


@pytest.mark.parametrize("count", [1, 3])
def test_responses_must_pair_one_to_one_with_prompts(count):
    """``score_many`` zips prompts with responses: a missing or extra response is refused with
    the count it needs, not scored as a shorter batch."""
    wl = Workload("basic_arithmetic", ListTokenizer(), 2)
    with pytest.raises(ValueError, match=rf"responses must hold one response per prompt \(2\), got {count}$"):
        wl.score_many(wl.batch(0), ["#### 1"] * count)


def test_chat_prompt_ids_are_not_coerced():
    with pytest.raises(TypeError, match="prompt_ids"):
        chat_prompt_ids(ListTokenizer([1.5, 2.7]), "hi")
    with pytest.raises(ValueError, match="prompt_ids must hold token ids in " + TOKEN_RANGE):
        chat_prompt_ids(ListTokenizer([-1]), "hi")
    with pytest.raises(TypeError, match="text must be a str"):
        chat_prompt_ids(ListTokenizer(), None)
    assert chat_prompt_ids(ListTokenizer(np.array([4, 5], np.int64)), "hi") == (4, 5)

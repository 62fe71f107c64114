"""PromptRoots: a sample's later calls (prompt + output + tool output, or a resumed tail) get the
group of the prompt they extend; prompts that extend none are roots of their own."""
from __future__ import annotations

import numpy as np
import pytest

from rollout_spec import prompt_roots
from rollout_spec.groups import prompt_group_id
from rollout_spec.prompt_roots import MAX_ROOTS_LIMIT, PromptRoots, prefix_hashes

PROMPT = [5, 17, 3, 900, 41]


def test_turns_that_extend_a_prompt_get_its_group_and_are_not_registered():
    roots = PromptRoots()
    group = roots.group_of(PROMPT)
    turn2 = PROMPT + [7, 7, 8] + [60, 61]  # the sample's output, then the tool's
    turn3 = turn2 + [9, 10] + [62]
    assert group == prompt_group_id(PROMPT), "a first call keeps the group it always had"
    assert roots.group_of(PROMPT) == group, "a sibling sample's first call"
    assert roots.group_of(turn2) == group and roots.group_of(np.array(turn3)) == group
    assert roots.group_of(turn3 + [1]) == group
    assert len(roots) == 1, "turn prompts never become roots: turn 3 still finds the dataset prompt"


def test_a_prompt_extending_no_root_is_a_new_root_with_its_own_group():
    roots = PromptRoots()
    roots.group_of(PROMPT)
    other = [5, 17, 4]  # shares a prefix with PROMPT, does not extend it
    assert roots.group_of(other) == prompt_group_id(other)
    assert roots.group_of(PROMPT[:3]) == prompt_group_id(PROMPT[:3]), "a prefix of a root is no turn of it"
    assert len(roots) == 3


def test_the_longest_of_nested_roots_wins():
    roots = PromptRoots()
    long, short = [1, 2, 3, 4, 5], [1, 2]
    roots.group_of(long)
    roots.group_of(short)  # registered after: it extends no root
    assert len(roots) == 2
    assert roots.group_of(long + [6]) == prompt_group_id(long)
    assert roots.group_of(short + [9]) == prompt_group_id(short)
    assert roots.group_of([1, 2, 3, 4]) == prompt_group_id(short)


def test_a_prefix_hash_collision_never_merges_groups(monkeypatch):
    """Every prefix hashing to 0: each candidate is confirmed by the prefix's own group id."""
    monkeypatch.setattr(prompt_roots, "prefix_hashes", lambda tokens: np.zeros(len(tokens), np.uint64))
    roots = PromptRoots()
    a, b = [1, 2, 3], [4, 5, 6]
    assert roots.group_of(a) == prompt_group_id(a)
    assert roots.group_of(b) == prompt_group_id(b) != prompt_group_id(a)
    assert roots.group_of(b + [7]) == prompt_group_id(b) and roots.group_of(a + [7]) == prompt_group_id(a)
    assert roots.group_of([4, 5]) == prompt_group_id([4, 5])
    assert len(roots) == 3


def test_the_least_recently_used_root_is_evicted_at_capacity():
    roots = PromptRoots(max_roots=2)
    a, b, c = [1, 1], [2, 2], [3, 3]
    roots.group_of(a)
    roots.group_of(b)
    roots.group_of(a + [8])  # a lookup refreshes a: b is now the oldest
    roots.group_of(c)
    assert len(roots) == 2
    assert roots.group_of(a + [9]) == prompt_group_id(a)
    assert roots.group_of(c + [9]) == prompt_group_id(c)
    assert roots.group_of(b + [9]) == prompt_group_id(b + [9]), "b was evicted: its turn is a root now"


def test_an_empty_prompt_is_never_a_root():
    roots = PromptRoots()
    assert roots.group_of([]) == prompt_group_id([])
    assert roots.group_of(PROMPT) == prompt_group_id(PROMPT) and len(roots) == 1


def test_prefix_hashes_wrap_mod_2_to_the_64():
    tokens = np.array([2**31 - 1, 0, 12345, 2**31 - 2, 7] * 40, dtype=np.int32)
    base, mod, expected, total = 0x9E3779B97F4A7C15, 2**64, [], 0
    for j, t in enumerate(tokens.tolist()):
        total = (total + t * pow(base, j, mod)) % mod
        expected.append(total)
    with np.errstate(over="raise"):
        assert prefix_hashes(tokens).tolist() == expected


@pytest.mark.parametrize("bad", [[1.5, 2.0], [1, -3], [[1, 2], [3, 4]], [True, 2], "abc"])
def test_bad_prompts_get_the_errors_of_prompt_group_id(bad):
    with pytest.raises((TypeError, ValueError)) as expected:
        prompt_group_id(bad)
    with pytest.raises(type(expected.value), match="^prompt_ids must") as got:
        PromptRoots().group_of(bad)
    assert str(got.value) == str(expected.value)


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-1, ValueError), (MAX_ROOTS_LIMIT + 1, ValueError),
                                        (2.0, TypeError), (True, TypeError), ("10", TypeError)])
def test_a_bad_capacity_is_refused_naming_max_roots(bad, error):
    with pytest.raises(error, match=rf"max_roots must .*\[1, {MAX_ROOTS_LIMIT}\]"):
        PromptRoots(max_roots=bad)


@pytest.mark.parametrize("bad, error", [
    (np.array([1.7, 2.2]), TypeError), (np.array([-1]), ValueError),
    (np.array([True, False]), TypeError), ([[1, 2]], TypeError),
])
def test_prefix_hashes_refuse_what_is_not_token_ids(bad, error):
    """A float or negative id was cast to uint64: another prompt's hash, without an error."""
    with pytest.raises(error, match="^tokens must"):
        prefix_hashes(bad)


def test_prefix_hashes_take_a_list_as_its_array():
    assert prefix_hashes([3, 4]).tolist() == prefix_hashes(np.array([3, 4], np.int32)).tolist()

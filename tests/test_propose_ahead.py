"""Proposals drafted ahead (``NgramDrafter.propose_ahead``): the same drafts and state as proposing then.

A twin that drafts ahead before every operation must give byte-identical proposals and leave
the same counters as a drafter that only proposes: a proposal drafted ahead is used by the
``propose`` with the same arguments, kept across a finish that does not evict, and dropped by
anything that changes what proposals read.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_spec.config import SpecConfig
from rollout_spec.drafter import NgramDrafter, proposes_ahead
from test_drafter_parallel import assert_same, make_twins, run_ops  # noqa: E402  (tests/ is on sys.path)
from test_drafter_reference import as_lists, best_path, config_st, op_st  # noqa: E402


def counters(d: NgramDrafter) -> int:
    """The counter a proposal changes."""
    return d.stats()["proposals"]


def started(d: NgramDrafter | None = None) -> NgramDrafter:
    """Three live requests of one group, sharing spans, with some output."""
    d = d or NgramDrafter(SpecConfig(num_draft_tokens=4))
    d.start_batch([0, 1, 2], [[1, 2, 3, 4, 1, 2, 3, 5], [1, 2, 3, 4], [9, 1, 2]], group_ids=[7, 7, 7])
    d.extend_batch([0, 1, 2], [[1, 2], [1], [3]])
    return d


def test_the_propose_with_the_same_arguments_takes_the_proposal_drafted_ahead():
    a, b = started(), started()
    a.propose_ahead([0, 1, 2], np.array([4, 2, 4]))
    assert_same(a.propose([0, 1, 2], [4, 2, 4]), b.propose([0, 1, 2], [4, 2, 4]))
    assert counters(a) == counters(b)
    assert (a.stats()["ahead_hits"], a.stats()["ahead_dropped"]) == (1, 0)
    # Taken once: the next call proposes afresh (from the state the first one left).
    assert_same(a.propose([0, 1, 2], [4, 2, 4]), b.propose([0, 1, 2], [4, 2, 4]))
    assert a.stats()["ahead_hits"] == 1 and counters(a) == counters(b)


@pytest.mark.parametrize("change", ["extend", "start", "set_noise_keys", "add_sequences", "end_step",
                                    "other budgets", "other ids"])
def test_a_change_or_other_arguments_drop_it(change):
    a, b = started(), started()
    a.propose_ahead([0, 1, 2], [4, 4, 4])
    ids, budgets = [0, 1, 2], [4, 4, 4]
    for d in (a, b):
        if change == "extend":
            d.extend_batch([1], [[2]])
        elif change == "start":
            d.start_batch([3], [[1, 2, 3]], group_ids=[7])
        elif change == "set_noise_keys":
            d.set_noise_keys([0, 1], [3, None], [1.0, 1.0], vocab_size=20)
        elif change == "add_sequences":
            d.add_sequences([7], [[1, 2, 3, 4, 6]])
        elif change == "end_step":
            d.end_step()
    if change == "other budgets":
        budgets = [4, 3, 4]
    if change == "other ids":
        ids, budgets = [2, 0], [4, 4]
    assert_same(a.propose(ids, budgets), b.propose(ids, budgets))
    assert counters(a) == counters(b)
    assert (a.stats()["ahead_hits"], a.stats()["ahead_dropped"]) == (0, 1)


@pytest.mark.parametrize("refused", ["extend unknown", "extend repeated", "background extend unknown",
                                     "propose unknown", "propose repeated", "propose finished"])
def test_a_refused_call_keeps_it(refused):
    """A call that raises changes nothing, the proposal drafted ahead included: the propose with
    the same arguments still takes it."""
    a, b = started(), started()
    a.propose_ahead([0, 1], [4, 4])
    if refused == "propose finished":  # a finish keeps it; the propose naming the finished id is refused
        for d in (a, b):
            d.finish_batch([1])
    calls = {"extend unknown": lambda d: d.extend_batch([99], [[1]]),
             "extend repeated": lambda d: d.extend_batch([0, 0], [[1], [2]]),
             "background extend unknown": lambda d: d.extend_batch([99], [[1]], background=True),
             "propose unknown": lambda d: d.propose([99]),
             "propose repeated": lambda d: d.propose([2, 2]),
             "propose finished": lambda d: d.propose([0, 1], [4, 4])}
    before = a.stats()
    with pytest.raises(ValueError, match="request id"):
        calls[refused](a)
    assert a.stats() == before
    if refused != "propose finished":
        assert_same(a.propose([0, 1], [4, 4]), b.propose([0, 1], [4, 4]))
        assert (a.stats()["ahead_hits"], a.stats()["ahead_dropped"]) == (1, 0)


def test_a_finish_keeps_it_unless_it_evicts():
    a, b = started(), started()
    a.propose_ahead([0, 1], [4, 4])
    for d in (a, b):
        d.finish_batch([2])
    assert_same(a.propose([0, 1], [4, 4]), b.propose([0, 1], [4, 4]))
    assert a.stats()["ahead_hits"] == 1 and counters(a) == counters(b)

    # A capacity of a few tokens: finishing a request evicts it, and the drafts change with it.
    a, b = (started(d) for d in make_twins(SpecConfig(num_draft_tokens=4), 2, capacity=16))
    a.propose_ahead([0, 1], [4, 4])
    for d in (a, b):
        d.finish_batch([2])
    assert a.stats()["evictions"] > 0
    assert_same(a.propose([0, 1], [4, 4]), b.propose([0, 1], [4, 4]))
    assert (a.stats()["ahead_hits"], a.stats()["ahead_dropped"]) == (0, 1)


def test_bad_arguments():
    d = started()
    with pytest.raises(ValueError, match=r"budgets must hold draft budgets in \[0, 1048576\]"):
        d.propose_ahead([0, 1], [4, -1])
    with pytest.raises(ValueError, match="one entry per request"):
        d.propose_ahead([0, 1], [4])
    with pytest.raises(TypeError, match="budgets"):
        d.propose_ahead([0, 1], [4.5, 1.0])
    # Unknown ids are the core's error, raised by the propose that names them.
    d.propose_ahead([0, 99], [4, 4])
    with pytest.raises(ValueError, match="unknown request id 99"):
        d.propose([0, 99], [4, 4])
    assert d.stats()["ahead_hits"] == 0
    d.check_integrity()


def test_capability():
    """NgramDrafter says it can; wrappers report the drafter they wrap."""
    from rollout_spec.metrics import DrafterProbe

    assert proposes_ahead(NgramDrafter()) and not proposes_ahead(object())
    probe = DrafterProbe(started())
    assert proposes_ahead(probe)
    probe.propose_ahead([0, 1], [4, 4])
    assert_same(probe.propose([0, 1], [4, 4]), started().propose([0, 1], [4, 4]))
    assert probe.stats()["ahead_hits"] == 1


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=config_st, ops=st.lists(op_st, min_size=1, max_size=40), capacity=st.integers(20, 80),
       guesses=st.lists(st.integers(0, 3), min_size=40, max_size=40))
def test_random_operations_with_proposals_drafted_ahead(cfg, ops, capacity, guesses):
    """The reference test's operations on a drafter that only proposes and on its twin, which
    drafts ahead before every operation (on a pool of 4 for two or more requests): for the next
    proposal's own arguments (guess 0-1), other budgets (2) or every live request (3)."""
    one, ahead = make_twins(cfg, min_requests=2, capacity=capacity)
    guess = iter(guesses)

    def draft_ahead(op: tuple, live: list[int]) -> None:
        ids, budgets, g = live, [3] * len(live), next(guess)
        if op[0] == "propose" and g < 3:
            ids = live[op[1] % len(live):]
            budgets = [op[2] + (g == 2)] * len(ids)
        ahead.propose_ahead(ids, budgets)

    run_ops(one, ahead, ops, before=draft_ahead)
    assert counters(one) == counters(ahead)


def test_engine_like_steps_take_most_proposals_drafted_ahead():
    """256 live requests, each step drafted ahead right after the extend (as the engine does),
    with a finish in between: the same drafts as proposing then, nearly all served ahead."""
    rng = np.random.default_rng(3)
    cfg = SpecConfig(num_draft_tokens=8)
    one, ahead = make_twins(cfg, min_requests=64)
    ids = list(range(256))
    motifs = [rng.integers(0, 40, 30).tolist() for _ in range(32)]
    for d in (one, ahead):
        d.start_batch(ids, [motifs[i // 8][: 10 + i % 8] for i in ids], [i // 8 for i in ids])
    budgets = [8] * len(ids)
    for step in range(20):
        batch = one.propose(ids, budgets)
        assert_same(batch, ahead.propose(ids, budgets))
        trees = as_lists(batch)
        commits = [best_path(trees[i])[: rng.integers(0, 4)] + [motifs[i // 8][(step + i) % 30]]
                   for i in range(len(ids))]
        for d in (one, ahead):
            d.extend_batch(ids, commits, background=True)
        gone, ids = ids[-1], ids[:-1]
        budgets = rng.integers(0, 9, len(ids)).tolist()
        ahead.propose_ahead(ids, budgets)
        for d in (one, ahead):
            d.finish_batch([gone])
    stats = ahead.stats()
    assert stats["ahead_hits"] == 19 and stats["ahead_dropped"] == 0
    assert counters(one) == counters(ahead)
    ahead.check_integrity()

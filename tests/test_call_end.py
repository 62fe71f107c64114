"""The drained call's pricing: per-request acceptance (CallEnd) and the budget's use of it."""

from __future__ import annotations

import numpy as np
import pytest

from rollout_spec.engine.budget import AcceptanceTracker, CostModel, DraftBudget
from rollout_spec.engine.call_end import CallEnd

IDS = np.arange(100, 132)
MEAN = np.array([0.0, 0.4, 0.7, 1.1])  # batch mean accepted at sizes 0, 1, 2, 4


def test_without_history_the_gain_is_the_batch_mean():
    """Equal rooms and no per-request figures: the drained gain is E(k) = 1 + mean accepted."""
    gains = CallEnd().gains(IDS, np.full(len(IDS), 200), MEAN)
    np.testing.assert_allclose(gains, 1.0 + MEAN)


def test_a_request_the_drafter_misses_caps_the_gain_when_it_has_the_most_left():
    """The slowest request decides: one that keeps nothing, with the most room, leaves drafting
    no gain; given less room than the others, it no longer decides."""
    ce = CallEnd(prior_steps=1.0)
    for _ in range(60):
        kept = np.full(len(IDS), 0.8)
        kept[0] = 0.0
        ce.observe(IDS, kept, np.full(len(IDS), 0.8))
    room = np.full(len(IDS), 100)
    room[0] = 300
    gains = ce.gains(IDS, room, MEAN)
    assert gains[0] == 1.0 and np.all(gains[1:] < 1.1)  # against E(k) = 1.4, 1.7, 2.1
    room[0] = 10
    gains = ce.gains(IDS, room, MEAN)
    assert np.all(gains[1:] > 1.0 + 0.9 * MEAN[1:])  # the others keep what the batch does


def test_a_call_with_no_room_left_gains_nothing_at_any_size():
    """Every request at its length limit: no size can save a step, so each gain is plain
    decoding's 1.0 (not a division by a zero step count)."""
    ce = CallEnd()
    ce.observe(IDS, np.full(len(IDS), 0.8), np.full(len(IDS), 0.8))
    np.testing.assert_array_equal(ce.gains(IDS, np.zeros(len(IDS)), MEAN), np.ones(len(MEAN)))


def test_ratios_are_pulled_towards_one_and_history_decays():
    """A single lucky step is mostly prior; many good steps win; old steps fade."""
    ce = CallEnd(decay=0.1, prior_steps=5.0)
    ce.observe(IDS[:1], [4.0], [1.0])
    one = ce.ratios(IDS[:1], 1.0)[0]
    assert 1.0 < one < 1.6
    for _ in range(50):
        ce.observe(IDS[:1], [4.0], [1.0])
    many = ce.ratios(IDS[:1], 1.0)[0]
    assert many > one and many > 2.0
    for _ in range(50):
        ce.observe(IDS[:1], [0.0], [1.0])
    assert ce.ratios(IDS[:1], 1.0)[0] < 0.5  # the recent steps outweigh the earlier ones
    assert ce.ratios(IDS[1:2], 1.0)[0] == 1.0  # nothing known


def test_histories_stay_with_their_ids_as_requests_come_and_go():
    """Ids arrive out of order and in any mix with known ones; each keeps its own sums."""
    ce = CallEnd(decay=1.0, prior_steps=0.0)  # decay 1: a ratio is its last step's
    ce.observe([50, 7], [2.0, 0.0], [1.0, 1.0])
    ce.observe([30, 7, 90], [3.0, 1.0, 0.5], [1.0, 2.0, 1.0])
    np.testing.assert_allclose(ce.ratios([90, 7, 50, 30, 11], 1.0), [0.5, 0.5, 2.0, 3.0, 1.0])
    ce.retain([7, 90])
    np.testing.assert_allclose(ce.ratios([50, 7, 90], 1.0), [1.0, 0.5, 0.5])


def test_retain_forgets_finished_requests():
    ce = CallEnd()
    ce.observe(IDS, np.ones(len(IDS)), np.ones(len(IDS)))
    ce.retain(IDS[:3])
    assert len(ce) == 3


@pytest.mark.parametrize("call, match", [
    (lambda ce: ce.observe(IDS, np.ones(3), np.ones(len(IDS))), "one length"),
    (lambda ce: ce.observe(IDS, -np.ones(len(IDS)), np.ones(len(IDS))), ">= 0"),
    (lambda ce: ce.observe([3, 4, 3], np.ones(3), np.ones(3)), "repeat"),
    (lambda ce: ce.gains(IDS, np.ones(3), MEAN), r"room must hold one entry per request, got shape \(3,\) for 32"),
    (lambda ce: ce.gains(IDS[:0], np.ones(0), MEAN), r"room must hold one entry per request, got shape \(0,\) for 0"),
    (lambda ce: CallEnd(decay=0.0), "decay"),
    (lambda ce: CallEnd(prior_steps=-1.0), "prior_steps"),
])
def test_bad_input_names_the_field(call, match):
    with pytest.raises(ValueError, match=match):
        call(CallEnd())


def flat_cost() -> CostModel:
    """A memory-bound step: drafting 4 nodes costs 20% more than a decode at every batch size."""
    batches, widths = (1, 64), (1, 2, 3, 5)
    return CostModel(batches, widths, tuple(tuple(1e-3 * (1 + 0.05 * (w - 1)) for w in widths)
                                            for _ in batches))


def budget_with(ids: np.ndarray, kept_by_request: np.ndarray) -> DraftBudget:
    """A budget whose batch keeps a draft's first node 35% of the time (E(1) = 1.35 against a
    5% tax) and which drafts for a predicted gain of 5% (as ``auto_budget``'s), fed per-request
    figures of 4-node drafts."""
    budget = DraftBudget(flat_cost(), AcceptanceTracker(4, prior=0.35), [1, 2, 4], min_gain=0.05)
    for _ in range(60):
        budget.observe_requests(ids, np.full(len(ids), 4), kept_by_request)
    return budget


def with_stragglers() -> tuple[DraftBudget, np.ndarray]:
    """``budget_with`` where four requests keep nothing and the rest 1.3 nodes a step, and the
    rooms: the four have 200 tokens left, the rest 50."""
    kept = np.full(len(IDS), 1.3)
    kept[:4] = 0.0
    room = np.full(len(IDS), 50)
    room[:4] = 200
    return budget_with(IDS, kept), room


def test_drained_budget_stops_drafting_for_a_straggler_the_drafter_misses():
    """The throughput rule drafts (E(1) = 1.35 for a 5% tax); once nothing waits
    and the request with the most tokens left keeps nothing, the call's end says plain."""
    budget, room = with_stragglers()
    budget.set_running(IDS, room, draining=False)
    assert budget.best(len(IDS)) > 0
    budget.set_running(IDS, room, draining=True)
    assert budget.best(len(IDS)) == 0
    assert budget.drained_asks == 0 and budget(len(IDS)) == 0 and budget.drained_asks == 1
    room[:4] = 5  # the stragglers are nearly done: the rest decide, and they gain
    budget.set_running(IDS, room, draining=True)
    assert budget.best(len(IDS)) > 0


def test_a_pick_under_the_throughput_rule_does_not_outlive_the_drain():
    """The budget reuses its pick for a few calls of one batch bucket; once nothing waits, the
    next call is priced by the call's end (and counted so), not the throughput rule's pick, and
    once samples wait again the throughput rule decides at once."""
    budget, room = with_stragglers()
    budget.set_running(IDS, room, draining=False)
    assert budget(len(IDS)) > 0
    budget.set_running(IDS, room, draining=True)
    assert budget(len(IDS)) == 0 and budget.drained_asks == 1
    budget.set_running(IDS, room, draining=False)
    assert budget(len(IDS)) > 0 and budget.drained_asks == 1


def test_drained_pricing_needs_the_reported_batch():
    """A report for another batch size (the batch changed since) falls back to the throughput rule."""
    throughput, room = with_stragglers()
    throughput.set_running(IDS, room, draining=False)
    budget, _ = with_stragglers()
    budget.set_running(IDS, room, draining=True)
    assert budget.best(len(IDS)) == 0  # the reported batch: the call's end says plain
    assert budget.best(len(IDS) - 1) == throughput.best(len(IDS) - 1) > 0


def test_set_running_validates_and_prunes_histories():
    budget = budget_with(IDS, np.ones(len(IDS)))
    with pytest.raises(ValueError, match="req_ids and room"):
        budget.set_running(IDS, np.ones(3), draining=True)
    budget.set_running(IDS[:2], np.ones(2, np.int64), draining=True)
    assert len(budget.call_end) == len(IDS)  # within 2 x running + 64: kept
    many = np.arange(1000, 1200)
    budget.observe_requests(many, np.ones(len(many), np.int64), np.ones(len(many), np.int64))
    budget.set_running(IDS[:2], np.ones(2, np.int64), draining=True)
    assert len(budget.call_end) == 2

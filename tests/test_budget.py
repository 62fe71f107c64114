"""Decision logic of the batch-aware draft budget on synthetic cost curves (CPU only)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from rollout_spec.engine.budget import (AcceptanceTracker, CostModel, DraftBudget, budget_from_cost,
                                        cached_cost_model, measure_cost_model)
from rollout_spec.engine.step_cost import OnlineStepCost
from rollout_spec.engine.throughput_guard import ThroughputGuard

BATCHES = (1, 8, 32, 64, 128, 256)
WIDTHS = (1, 2, 3, 5, 9)


def synthetic_cost(launch: float, per_token: float, weights: float = 1e-3) -> CostModel:
    """Step time = weight streaming (fixed) + launch + compute growing with B*W tokens.

    Small B is memory/launch bound (verify tax ~1); large B is compute bound (tax ~W).
    """
    grid = tuple(tuple(weights + launch + per_token * b * w for w in WIDTHS) for b in BATCHES)
    return CostModel(BATCHES, WIDTHS, grid)


def tracker_with_rate(rate: float, max_draft: int = 8) -> AcceptanceTracker:
    t = AcceptanceTracker(max_draft, prior=rate)
    return t


def test_small_batch_drafts_deep_large_batch_turns_speculation_off():
    """Cheap verification at B=1 buys the deepest draft; compute-bound B=256 buys none."""
    cost = synthetic_cost(launch=2e-4, per_token=2e-5)
    budget = DraftBudget(cost, tracker_with_rate(0.8), candidates=[1, 2, 4, 8])
    assert budget.best(1) == 8
    assert budget.best(256) == 0
    picks = [budget.best(b) for b in BATCHES]
    assert picks == sorted(picks, reverse=True)  # never more drafting as the batch grows


def test_no_acceptance_means_no_drafts_and_high_acceptance_means_drafts():
    cost = synthetic_cost(launch=2e-4, per_token=2e-5)
    assert DraftBudget(cost, tracker_with_rate(0.0), [1, 2, 4]).best(1) == 0
    assert DraftBudget(cost, tracker_with_rate(0.95), [1, 2, 4]).best(8) == 4


def test_choice_maximises_predicted_throughput():
    """The pick is the argmax of B*E(k)/T(B,k+1) over the candidates, 0 included."""
    cost = synthetic_cost(launch=1e-4, per_token=5e-6)
    budget = DraftBudget(cost, tracker_with_rate(0.6), [1, 2, 4, 8])
    for b in (1, 16, 64, 200, 300):
        k = budget.best(b)
        assert all(budget.throughput(b, k) >= budget.throughput(b, c) for c in (0, 1, 2, 4, 8))


@pytest.mark.parametrize("catch_up", [3e-3, 1e-4])
def test_probes_back_off_while_catch_up_is_costly_and_reset_once_drafting_passes(catch_up):
    """Probes whose catch-up costs more than a quarter of their step (3 ms on a 1 ms step) come
    after 3, 6, 12, then every 24 plain calls (8 x probe_every); cheap ones (0.1 ms) every 3. A
    drafting pick that passes brings the gap back to ``probe_every``."""
    cost = synthetic_cost(launch=2e-4, per_token=2e-5)
    budget = DraftBudget(cost, tracker_with_rate(0.0), [2, 4], probe_every=3)
    picks = []
    for _ in range(69):
        picks.append(budget(8))
        if picks[-1]:  # the engine records each step; a probe hands over the deferred tokens
            budget.record_step(8, 16, 16, 3, 1e-3 + catch_up, tokens=8, catch_up=catch_up)
    probes = [i for i, p in enumerate(picks) if p]
    assert probes == ([2, 5, 11, 23, 47] if catch_up > 1e-3 else list(range(2, 69, 3)))
    assert set(picks) == {0, 2}
    budget.tracker.reset(0.9)
    assert budget(16) > 0
    budget.tracker.reset(0.0)
    assert [budget(8) for _ in range(3)] == [0, 0, 2]


def test_tracker_learns_expected_tokens_per_size():
    """Requests accept each depth with probability 0.7: every offered size's mean converges to
    its own sum of 0.7 ** d; sizes never offered keep the prior's."""
    rng = np.random.default_rng(0)
    t = AcceptanceTracker(8, prior=0.1, decay=0.0005)
    for i in range(300):
        offered = np.full(64, 4 if i % 2 else 2)
        accepted = np.minimum((rng.random((64, 4)) < 0.7).cumprod(axis=1).sum(axis=1), offered)
        t.update(offered, accepted)
    for k in (2, 4):
        assert t.expected_tokens(k) == pytest.approx(1 + sum(0.7 ** d for d in range(1, k + 1)), rel=0.03)
    assert t.expected_tokens(8) == pytest.approx(1 + sum(0.1 ** d for d in range(1, 9)))
    assert t.expected_tokens(0) == 1.0 and t.expected_tokens(100) == t.expected_tokens(8)


def test_tracker_takes_every_size_from_one_tree_and_resets():
    t = AcceptanceTracker(3, prior=0.5, decay=1.0)
    t.update(np.array([2, 2, 3]), np.array([0, 2, 1]))  # sizes 2 and 3 measured, 1 not
    assert t.accepted.tolist() == [0.0, 0.5, 1.0, 1.0]
    t.update_sizes(np.array([[0, 1, 1, 2], [0, 0, 1, 1]]))  # two requests, walked at every size
    assert t.accepted.tolist() == [0.0, 0.5, 1.0, 1.5]
    t.update_sizes(np.array([[0, 1]]))  # a narrower measurement moves only its sizes
    assert t.accepted.tolist() == [0.0, 1.0, 1.0, 1.5]
    t.reset(0.5)
    assert t.accepted.tolist() == [0.0, 0.5, 0.75, 0.875] and not t.seen.any()


def test_tracker_rejects_inconsistent_counts():
    t = AcceptanceTracker(3)
    with pytest.raises(ValueError, match="accepted"):
        t.update(np.array([1, 2]), np.array([2, 0]))
    with pytest.raises(ValueError, match="prior"):
        AcceptanceTracker(3, prior=1.5)
    with pytest.raises(ValueError, match=r"\[0, k\]"):
        t.update_sizes(np.array([[0, 2]]))
    with pytest.raises(ValueError, match="shape"):
        t.update_sizes(np.array([1, 2]))


def test_cost_model_interpolates_and_round_trips(tmp_path):
    cost = synthetic_cost(launch=1e-4, per_token=1e-6)
    assert cost.step_time(8, 1) == pytest.approx(1e-3 + 1e-4 + 8e-6)
    assert cost.step_time(20, 4) == pytest.approx(1e-3 + 1e-4 + 80e-6)  # linear between points
    assert cost.step_time(512, 1) == pytest.approx(2 * cost.step_time(256, 1))
    assert cost.verify_tax(8, 1) == 1.0 and cost.verify_tax(256, 9) > cost.verify_tax(1, 9)
    assert CostModel.from_json(cost.to_json()) == cost


def test_cached_cost_model_measures_once(tmp_path, caplog):
    calls = []

    def measure() -> CostModel:
        calls.append(1)
        return synthetic_cost(1e-4, 1e-6)

    a = cached_cost_model(tmp_path, "H100/smollm2 bf16", measure)
    b = cached_cost_model(tmp_path, "H100/smollm2 bf16", measure)
    assert a == b and len(calls) == 1
    cache = next(tmp_path.iterdir())
    for text in ("{not json", '{"widths": [1]}', "[1, 2]", '{"batch_sizes": 3, "widths": [1], "seconds": []}'):
        cache.write_text(text)  # corrupt: measured again, with a warning, and replaced
        with caplog.at_level("WARNING", logger="rollout_spec.engine.budget"):
            assert cached_cost_model(tmp_path, "H100/smollm2 bf16", measure) == a
        assert f"cost model cache {cache} is corrupt" in caplog.text
        assert CostModel.from_json(cache.read_text()) == a
    assert len(calls) == 5
    cache.unlink()
    cache.mkdir()  # a folder in the cache file's place: measured, used, warned about
    assert cached_cost_model(tmp_path, "H100/smollm2 bf16", measure) == a
    assert len(calls) == 6 and "could not be written" in caplog.text


def test_cached_cost_model_interrupted_write_leaves_no_file(tmp_path, monkeypatch):
    """Stopped between writing and renaming, the cache holds nothing: the next run measures
    again instead of refusing a half-written file."""
    import os

    def interrupted(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cached_cost_model(tmp_path, "H100", lambda: synthetic_cost(1e-4, 1e-6))
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    cached_cost_model(tmp_path, "H100", lambda: synthetic_cost(1e-4, 1e-6))
    assert [p.name for p in tmp_path.iterdir()] == ["cost_H100.json"]


def test_measure_cost_model_times_each_cell():
    seen = []
    cost = measure_cost_model(lambda b, w: seen.append((b, w)), lambda: None, [1, 4], [1, 3],
                              repeats=3, warmup=1)
    assert cost.batch_sizes == (1, 4) and cost.widths == (1, 3)
    assert len(seen) == 4 * (3 + 1) and seen.count((4, 3)) == 4


@pytest.mark.parametrize("kwargs,match", [
    (dict(batch_sizes=(1, 8), widths=(2, 3), seconds=((1, 1), (1, 1))), "widths"),
    (dict(batch_sizes=(8, 1), widths=(1, 2), seconds=((1, 1), (1, 1))), "batch_sizes"),
    (dict(batch_sizes=(1, 8), widths=(1, 2), seconds=((1, 0), (1, 1))), "seconds"),
    (dict(batch_sizes=(1,), widths=(1, 2), seconds=((1, 1), (1, 1))), "grid"),
])
def test_cost_model_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CostModel(**kwargs)


def test_auto_budget_measures_grid_and_caches(tmp_path):
    """auto_budget times every (B, k+1) cell once, then reuses the cached model."""
    from rollout_spec.engine.budget import auto_budget

    seen = set()
    make = lambda: auto_budget(lambda b, w: seen.add((b, w)), lambda: None, "gpu/model",
                               max_batch=48, max_draft=8, cache_dir=tmp_path)
    budget = make()
    assert budget.candidates == (0, 1, 2, 4, 8)
    assert seen == {(b, w) for b in (1, 8, 32, 48) for w in (1, 2, 3, 5, 9)}
    seen.clear()
    assert make().cost == budget.cost and not seen


def test_observe_feeds_the_tracker():
    budget = DraftBudget(synthetic_cost(2e-4, 2e-5), AcceptanceTracker(4, prior=0.5, decay=1.0), [4])
    budget.observe(np.array([4, 4]), np.array([0, 0]))
    assert budget.tracker.expected_tokens(4) == 1.0 and budget.best(1) == 0


def test_online_step_cost_recovers_a_linear_residual():
    """Residual = 0.2 ms + 4 us/request (+ 1 us/node when drafting), seen at varying B and N: the
    global models recover the law; the per-bucket ones predict within their bucket's spread."""

    rng = np.random.default_rng(0)
    host = OnlineStepCost(max_batch=256, max_nodes=2048, decay=0.01)
    for _ in range(400):
        b = int(rng.integers(1, 257))
        n = int(rng.integers(1, 8 * b + 1))
        host.observe(False, b, 0, 2e-4 + 4e-6 * b)
        host.observe(True, b, n, 2e-4 + 4e-6 * b + 1e-6 * n)
    assert host.plain.predict(np.array([1.0, 100 / 256])) == pytest.approx(6e-4, rel=0.02)
    assert host.spec.predict(np.array([1.0, 64 / 256, 512 / 2048])) == pytest.approx(968e-6, rel=0.02)
    assert host.residual(False, 100, 0) == pytest.approx(6e-4, rel=0.1)
    assert host.residual(True, 64, 512) == pytest.approx(968e-6, rel=0.1)
    assert host.counts() == (400, 400)


def test_local_models_fix_what_a_global_line_cannot():
    """Host cost flat above B=64 (e.g. the drafter's per-call floor): after steps at B=256 the
    prediction there is the measured one, not the line through the small batches."""

    host = OnlineStepCost(max_batch=256, max_nodes=2048)
    cost = lambda b: 1e-3 + 4e-5 * min(b, 64)  # noqa: E731
    for _ in range(50):
        for b in (8, 16, 32, 64):
            host.observe(True, b, 4 * b, cost(b))
    assert host.residual(True, 256, 1024) > 1.2 * cost(256)  # the global line overshoots
    for _ in range(5):
        host.observe(True, 256, 1024, cost(256))
    assert host.residual(True, 256, 1024) == pytest.approx(cost(256), rel=0.1)
    assert host.residuals(256, np.array([0.0, 1024.0]))[1] == pytest.approx(host.residual(True, 256, 1024))


def test_online_step_cost_starts_optimistic_and_rejects_bad_input():

    host = OnlineStepCost(max_batch=8, max_nodes=64)
    assert host.residual(True, 8, 64) == 0.0 and host.residual(False, 8, 0) == 0.0
    with pytest.raises(ValueError, match="batch"):
        host.observe(True, 0, 4, 1e-3)
    with pytest.raises(ValueError, match="residual_seconds"):
        host.observe(True, 4, 4, float("nan"))
    with pytest.raises(ValueError, match="decay"):
        OnlineStepCost(8, 64, decay=0.0)


def run_budget(budget: DraftBudget, batch: int, gpu: CostModel, host_spec: float, host_plain: float,
               steps: int, rate: float = 0.6) -> list[int]:
    """Drive a budget like the engine does, with an injected clock: wall = GPU grid + host time.

    Every request accepts each offered depth with probability ``rate``; the drafter fills the
    whole budget. Returns the sizes the budget picked.
    """
    rng = np.random.default_rng(1)
    picks = []
    for _ in range(steps):
        k = budget(batch)
        picks.append(k)
        offered = np.full(batch, k)
        if k:
            accepted = (rng.random((batch, k)) < rate).cumprod(axis=1).sum(axis=1)
            budget.observe(offered, accepted)
        wall = gpu.step_time(batch, k + 1) + (host_spec * batch if k else host_plain * batch)
        budget.record_step(batch, int(offered.sum()), int(offered.sum()), k + 1, wall)
    return picks


def gpu_grid() -> CostModel:
    """A GPU on which verification is cheap: W=9 costs 1.2x a decode at every B."""
    grid = tuple(tuple(3e-3 * (1 + 0.025 * (w - 1)) * (1 + b / 256) for w in WIDTHS) for b in BATCHES)
    return CostModel(BATCHES, WIDTHS, grid)


def test_acceptance_measured_on_plain_steps_replaces_probes_while_the_model_says_plain():
    """With ``observe_plain`` reporting low acceptance every 3 calls, a pick of 0 is never
    probed; once it stops reporting, probes resume; high acceptance from it turns drafting on."""
    cost = synthetic_cost(launch=2e-4, per_token=2e-5)
    budget = DraftBudget(cost, tracker_with_rate(0.0), [2, 4], probe_every=3)
    picks = []
    for i in range(40):
        if i % 3 == 0:
            budget.observe_plain(np.zeros((16, 5)))  # 16 requests, nothing kept at any size
        picks.append(budget(8))
    assert picks == [0] * 40  # without observe_plain: probes at 2, 5, 8, ... (test above)
    assert [budget(8) for _ in range(5)] == [0, 0, 2, 0, 0]  # no fresh figures: probes again
    for _ in range(40):
        budget.observe_plain(np.tile(np.arange(5), (16, 1)))  # everything kept
    assert budget.best(8) == 4 and budget.tracker.expected_tokens(4) > 4.9


def drive_with_shadow_rounds(budget: DraftBudget, batch: int, gpu: CostModel, host: float,
                             steps: int, rate: float = 0.6, switch_cost: float = 0.0) -> Counter:
    """Drive ``budget`` like the engine with shadow rounds: plain steps report acceptance at
    every size (``observe_plain``) every 4 plain steps, drafting steps their own outcome; wall =
    GPU grid + ``host`` seconds (the same on both paths), plus ``switch_cost`` on a drafting step
    right after a plain one, reported as its catch-up. Returns the decisions by reason."""
    rng = np.random.default_rng(3)
    before = Counter(budget.decisions)
    plain, last_plain = 0, True
    for _ in range(steps):
        k = budget(batch)
        if k == 0:
            plain += 1
            if plain % 4 == 0:
                depth = (rng.random((16, 8)) < rate).cumprod(axis=1).sum(axis=1)
                budget.observe_plain(np.minimum(depth[:, None], np.arange(9)))
            budget.record_step(batch, 0, 0, 1, gpu.step_time(batch, 1) + host, tokens=batch)
            last_plain = True
            continue
        accepted = (rng.random((batch, k)) < rate).cumprod(axis=1).sum(axis=1)
        budget.observe(np.full(batch, k), accepted)
        catch_up = switch_cost if last_plain else 0.0
        budget.record_step(batch, batch * k, batch * k, k + 1,
                           gpu.step_time(batch, k + 1) + host + catch_up,
                           tokens=batch + int(accepted.sum()), catch_up=catch_up)
        last_plain = False
    after = Counter(budget.decisions)
    after.subtract(before)
    return +after


def test_stalls_on_a_buckets_first_drafting_steps_do_not_price_drafting_out_for_good():
    """Three drafting steps that met 50 ms stalls (kernels compiling) are a batch bucket's only
    drafting residual; shadow rounds then keep acceptance fresh, so no ordinary probe comes.
    The model says plain at first, but probes at the size drafting would get at plain's host
    cost re-measure the residual, and drafting takes over again (without the stalls it drafts
    from the start; before session 15, in a simulation, three stalls of 4 ms kept it off for good)."""
    gpu = gpu_grid()
    for stalled in (False, True):
        budget = budget_from_cost(gpu, 256, 8)
        if stalled:
            for _ in range(3):
                budget.record_step(128, 512, 512, 5, gpu.step_time(128, 5) + 0.05, tokens=200)
            assert budget.best(128) == 0  # priced out by the stalls
        first = drive_with_shadow_rounds(budget, 128, gpu, host=3e-4, steps=600)
        later = drive_with_shadow_rounds(budget, 128, gpu, host=3e-4, steps=400)
        if stalled:
            assert first["model"] > 0 and first["probe"] >= 2
        else:
            assert first["model"] == 0
        assert later["drafted"] >= 0.9 * 400 - later["plain for the guard"]
        assert budget.best(128) > 0


def test_a_stall_on_a_buckets_first_drafting_step_is_capped_for_the_guard_too():
    """The guard takes a bucket's first step as its average as is: a 200 ms stall there kept
    drafting vetoed for hundreds of steps. With a residual model the guard gets the step capped
    like the residual (one grid step of excess, or twice the prediction); without one, as is."""
    gpu = gpu_grid()
    normal = gpu.step_time(128, 5) + 3e-4
    figures = {}
    for name, budget in (("capped", budget_from_cost(gpu, 256, 8)),
                         ("raw", DraftBudget(gpu, AcceptanceTracker(8), [4], guard=ThroughputGuard()))):
        budget.record_step(128, 512, 512, 5, normal + 0.2, tokens=200)  # the stall
        for _ in range(6):
            budget.record_step(128, 512, 512, 5, normal, tokens=200)
        figures[name] = budget.guard.seconds_per_token(True, 128) * 200
    assert figures["capped"] < 1.3 * normal
    assert figures["raw"] > 5 * normal


def test_a_drafting_run_that_pays_is_not_vetoed_for_its_switch_costs():
    """Drafting at B=128 emits tokens ~18% faster than plain once it runs, but its first step
    after plain ones costs a whole step more (the catch-up: deferred tokens, a proposal nothing
    drafted ahead). The guard's plain steps and the probes make such switches now and then; had
    the guard counted them, drafting would look slower than plain and stay vetoed (session 16:
    at B=256, T=1.0 on the H100 the guard had drafting at 32 us a token against 24 plain, where a
    run of drafting steps gave 19.5). It drafts nearly every step."""
    gpu = gpu_grid()
    budget = budget_from_cost(gpu, 256, 8)
    step = gpu.step_time(128, 1) + 3e-4
    decisions = drive_with_shadow_rounds(budget, 128, gpu, host=3e-4, steps=1500, rate=0.2,
                                         switch_cost=step)
    assert decisions["drafted"] >= 0.9 * 1500, decisions
    assert budget.guard.allows_drafting(128)


def test_no_residual_probes_where_drafting_at_plain_cost_would_not_pay():
    """Where even a drafting step at plain's host cost loses (verification costs W times a
    decode), a pick of 0 with fresh shadow acceptance is never probed."""
    gpu = synthetic_cost(launch=0.0, per_token=2e-5, weights=0.0)
    budget = budget_from_cost(gpu, 256, 8)
    decisions = drive_with_shadow_rounds(budget, 256, gpu, host=3e-4, steps=1000)
    assert decisions["probe"] == 0 and decisions["drafted"] <= 8  # the optimistic start only


def test_budget_turns_speculation_off_when_host_cost_eats_the_gain():
    """GPU alone says draft (E(4) = 2.3 for a 1.1x tax); 40 us/request of drafting host time at
    B=256 (10 ms on a 6 ms step) makes every draft size lose, so the budget settles on 0 and only
    probes now and then."""

    gpu = gpu_grid()
    naive = DraftBudget(gpu, AcceptanceTracker(8, prior=0.6), [1, 2, 4, 8])
    assert naive.best(256) >= 4  # the GPU-only model would draft
    budget = DraftBudget(gpu, AcceptanceTracker(8, prior=0.6), [1, 2, 4, 8], probe_every=32,
                         host=OnlineStepCost(256, 2048))
    picks = run_budget(budget, 256, gpu, host_spec=40e-6, host_plain=2e-6, steps=200)
    assert picks[0] > 0  # optimistic start: speculation is tried
    tail = picks[100:]
    assert tail.count(0) >= 0.9 * len(tail)
    assert set(tail) <= {0, 1}  # only the smallest size is probed


def test_budget_keeps_drafting_when_host_cost_is_small():

    gpu = gpu_grid()
    budget = DraftBudget(gpu, AcceptanceTracker(8, prior=0.6), [1, 2, 4, 8], host=OnlineStepCost(256, 2048))
    picks = run_budget(budget, 32, gpu, host_spec=4e-6, host_plain=2e-6, steps=200)
    assert all(k >= 4 for k in picks[20:])
    # the learned step time matches the injected clock on both paths
    assert budget.step_time(32, 8) == pytest.approx(gpu.step_time(32, 9) + 32 * 4e-6, rel=0.05)


def test_record_step_tracks_the_drafter_fill_and_validates():

    budget = DraftBudget(gpu_grid(), AcceptanceTracker(8), [8], host=OnlineStepCost(256, 2048))
    for _ in range(200):
        budget.record_step(8, offered=64, nodes=16, width=9, seconds=5e-3)
    assert budget.fill == pytest.approx(0.25, abs=0.01)
    with pytest.raises(ValueError, match="width"):
        budget.record_step(8, offered=64, nodes=16, width=0, seconds=5e-3)
    plain = DraftBudget(gpu_grid(), AcceptanceTracker(8), [8])  # no host model: GPU grid only
    plain.record_step(8, 64, 16, 9, 1.0)
    assert plain.step_time(8, 8) == gpu_grid().step_time(8, 9)


def test_one_off_stalls_are_capped_but_a_real_high_cost_is_learned():
    """A 300 ms compile stall on one drafting step barely moves the spec residual; a residual
    that really is 10x the GPU step is reached within about a hundred steps despite the cap."""

    gpu = gpu_grid()
    t = gpu.step_time(64, 5)
    budget = DraftBudget(gpu, AcceptanceTracker(8, prior=0.6), [4], host=OnlineStepCost(256, 2048))
    for _ in range(30):
        budget.record_step(64, 256, 256, 5, t + 1e-3)
    budget.record_step(64, 256, 256, 5, t + 0.3)  # the stall
    assert budget.host.residual(True, 64, 256) < 2e-3
    for _ in range(120):
        budget.record_step(64, 256, 256, 5, t + 10 * t)
    assert budget.host.residual(True, 64, 256) == pytest.approx(10 * t, rel=0.1)


def test_guard_vetoes_drafting_that_was_measured_slower_and_probes_keep_it_fresh():
    """The model wants to draft (high acceptance); steps of this batch size drafted at 3.0 us
    per token against 1.0 us plain, so drafting stops except for probes at the model's pick.
    Another batch bucket is untouched; once probes show drafting paying, the veto lifts."""
    guard = ThroughputGuard(decay=0.5, min_steps=2)
    budget = DraftBudget(synthetic_cost(2e-4, 2e-5), tracker_with_rate(0.9), [1, 2, 4, 8],
                         probe_every=3, guard=guard)
    k = budget.best(8)
    assert k > 0 and budget(8) == k  # nothing measured yet: the model decides
    for _ in range(2):
        budget.record_step(8, 0, 0, 1, 8e-6, tokens=8)  # plain: 1 us per token
        budget.record_step(8, 8 * k, 8 * k, k + 1, 3 * 16e-6, tokens=16)  # drafting: 3 us
    assert not guard.allows_drafting(8) and guard.allows_drafting(128)
    assert [budget(8) for _ in range(9)] == [0, 0, k] * 3  # probes (no catch-up measured)
    assert budget(128) == budget.best(128)
    for _ in range(4):  # the probes drafted well: 0.5 us per token
        budget.record_step(8, 8 * k, 8 * k, k + 1, 0.5 * 16e-6, tokens=16)
    assert guard.allows_drafting(8) and budget(8) == k


def test_catch_up_counts_for_neither_the_guard_nor_the_cost_model():
    """A drafting step that first caught up for 1 ms (deferred tokens, a proposal nothing drafted
    ahead): the guard and the residual model learn from it what they learn from a step 1 ms
    shorter, with a residual model or without one. A run of drafting steps pays that once; at
    B=256, T=1.0 on the H100 the guard's figure from such probes was 1.6x a run's own."""
    def budget(host: bool) -> DraftBudget:
        return DraftBudget(synthetic_cost(2e-4, 2e-5), tracker_with_rate(0.9), [4],
                           host=OnlineStepCost(64, 512) if host else None,
                           guard=ThroughputGuard(decay=1.0, min_steps=1))
    for host in (True, False):
        with_catch_up, without = budget(host), budget(host)
        gpu = with_catch_up.cost.step_time(8, 5)
        with_catch_up.record_step(8, 32, 32, 5, gpu + 2e-3, tokens=16, catch_up=1e-3)
        without.record_step(8, 32, 32, 5, gpu + 1e-3, tokens=16)
        assert with_catch_up.guard.seconds_per_token(True, 8) == pytest.approx((gpu + 1e-3) / 16)
        assert without.guard.seconds_per_token(True, 8) == pytest.approx((gpu + 1e-3) / 16)
        if host:
            assert with_catch_up.host.residual(True, 8, 32) == pytest.approx(without.host.residual(True, 8, 32))
            assert with_catch_up.host.residual(True, 8, 32) > 0
    with pytest.raises(ValueError, match="catch_up"):
        with_catch_up.record_step(8, 32, 32, 5, 1e-3, tokens=16, catch_up=2e-3)


def test_a_first_step_timed_at_zero_is_no_base_for_the_guard():
    """A coarse clock can time a first step at 0 s; capped at 3x that, every later step would
    have kept the plain average at 0 and vetoed drafting in the bucket for good."""
    guard = ThroughputGuard(decay=0.25, min_gain=0.05)
    guard.observe(False, 64, 64, 0.0)
    for _ in range(50):
        guard.observe(False, 64, 64, 5e-3)
        guard.observe(True, 64, 128, 6e-3)
    assert guard.seconds_per_token(False, 64) == pytest.approx(5e-3 / 64)
    assert guard.allows_drafting(64)


def test_bad_figures_are_refused_by_name():
    """A negative, NaN or infinite step time, a NaN acceptance and a batch of 0 are errors naming
    the field (NaN passed every `<` check before and stuck in the means; batch 0 hit log2)."""
    from rollout_spec.engine.call_end import CallEnd
    from rollout_spec.engine.step_cost import batch_bucket

    budget = budget_from_cost(synthetic_cost(1e-3, 1e-5), 64, 8)
    for seconds in (-1e-3, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"seconds must be finite and >= 0"):
            budget.record_step(64, 0, 0, 1, seconds, tokens=64)
    acceptance = np.zeros((1, 9))
    acceptance[0, 4] = np.nan
    with pytest.raises(ValueError, match=r"accepted\[r, k\] must be in \[0, k\]"):
        budget.observe_plain(acceptance)
    with pytest.raises(ValueError, match="accepted and expected must be finite and >= 0"):
        CallEnd().observe(np.array([1]), np.array([np.nan]), np.array([1.0]))
    with pytest.raises(ValueError, match=r"batch must be in \[1, 1048576\], got 0"):
        batch_bucket(0)


def test_a_clock_that_steps_back_costs_the_budget_one_figure_not_the_call():
    """An engine clock stepping back (an NTP correction) gives a negative step time: that step
    is not recorded, and generate finishes with plain decoding's tokens."""
    import itertools

    from rollout_spec import SamplingParams, SpecConfig
    from rollout_spec.engine import RolloutEngine
    from test_engine import tiny_pair

    _, model = tiny_pair("llama")
    budget = budget_from_cost(synthetic_cost(1e-3, 1e-5), 8, 4)
    eng = RolloutEngine(model, None, SpecConfig(num_draft_tokens=4), draft_budget=budget, num_slots=8,
                        max_model_len=256)
    reads = itertools.count()

    def clock() -> float:  # monotone but for one step back of 1 s at the 30th read
        n = next(reads)
        return n * 1e-3 - (1.0 if n >= 30 else 0.0)

    eng.clock = clock
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=40)
    outs = eng.generate([[5, 6, 7], [8, 9]], params)
    plain = RolloutEngine(model, None, None, num_slots=8, max_model_len=256).generate([[5, 6, 7], [8, 9]], params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]


def test_guard_ignores_steps_without_tokens_and_caps_a_stall():
    """One compile stall (1000x a normal step) moves a bucket's average by at most 3x per step,
    so a path measured 2x faster stays allowed; bad inputs name the field."""
    guard = ThroughputGuard(decay=0.1, min_steps=1)
    guard.observe(False, 64, 64, 64e-6)
    guard.observe(True, 64, 128, 64e-6)  # drafting: 0.5 us per token
    guard.observe(True, 64, 128, 1000 * 64e-6)
    assert guard.seconds_per_token(True, 64) == pytest.approx(0.5e-6 * 1.2)
    assert guard.allows_drafting(64)
    budget = DraftBudget(synthetic_cost(2e-4, 2e-5), tracker_with_rate(0.9), [4], guard=guard)
    budget.record_step(64, 0, 0, 1, 1.0)  # no token count: the guard learns nothing
    assert guard.seconds_per_token(False, 64) == pytest.approx(1e-6)
    with pytest.raises(ValueError, match="tokens"):
        guard.observe(True, 64, 0, 1e-3)
    with pytest.raises(ValueError, match="seconds"):
        guard.observe(True, 64, 10, float("nan"))
    with pytest.raises(ValueError, match="min_steps"):
        ThroughputGuard(min_steps=0)


def test_guard_rates_uneven_drafting_steps_by_total_tokens_over_total_time():
    """B=1: drafting steps of 1 s emit 1 or 3 tokens in turn (0.5 s per token overall), plain
    steps 1 token in 0.6 s. Drafting is faster and stays allowed; an average of each step's own
    seconds per token (0.67) would veto it."""
    guard = ThroughputGuard(decay=0.1, min_steps=4, min_gain=0.02)
    for i in range(200):
        guard.observe(True, 1, 1 if i % 2 else 3, 1.0)
        guard.observe(False, 1, 1, 0.6)
    assert guard.seconds_per_token(True, 1) == pytest.approx(0.5, rel=0.06)
    assert guard.allows_drafting(1)


def test_guard_asks_for_a_plain_step_now_and_then_until_it_can_compare():
    """A budget that always drafts would never give the guard plain steps to compare with: one
    call in 4 returns 0 until the bucket has ``min_steps`` plain steps, then never again."""
    guard = ThroughputGuard(min_steps=2)
    budget = DraftBudget(synthetic_cost(2e-4, 2e-5), tracker_with_rate(0.9), [1, 2, 4, 8], guard=guard)
    k = budget.best(8)
    picks = [budget(8) for _ in range(8)]
    assert [i for i, p in enumerate(picks) if p == 0] == [3, 7] and set(picks) == {0, k}
    for _ in range(2):
        budget.record_step(8, 0, 0, 1, 4e-3, tokens=8)
    assert not guard.wants_plain(8) and guard.wants_plain(64)
    assert all(budget(8) == k for _ in range(40))


def test_guard_refreshes_its_plain_figure_while_drafting_runs():
    """After ``refresh_every`` drafting steps of a bucket without a plain one, the budget returns
    one plain step (the bucket's plain figure is then current); other buckets are unaffected.
    Drafting leads by 100% here, so the gap is stretched only with ``refresh_lead`` below 1."""
    guard = ThroughputGuard(min_steps=1, refresh_every=5, refresh_lead=1.0)
    budget = DraftBudget(synthetic_cost(2e-4, 2e-5), tracker_with_rate(0.9), [1, 2, 4, 8], guard=guard)
    k = budget.best(8)
    guard.observe(False, 8, 8, 8e-6)
    guard.observe(False, 64, 64, 64e-6)
    for _ in range(4):
        guard.observe(True, 8, 16, 8e-6)
    assert not guard.wants_plain(8) and budget(8) == k
    guard.observe(True, 8, 16, 8e-6)
    assert guard.wants_plain(8) and not guard.wants_plain(64)
    assert [budget(8) for _ in range(3)] == [k, k, 0]  # at most one plain call in four
    guard.observe(False, 8, 8, 8e-6)
    assert not guard.wants_plain(8) and all(budget(8) == k for _ in range(10))
    with pytest.raises(ValueError, match="refresh_every"):
        ThroughputGuard(refresh_every=0)


def test_guard_refreshes_less_often_the_more_drafting_leads():
    """The gap between plain steps is ``refresh_every`` up to a lead of ``refresh_lead``, grows in
    proportion beyond it and stops at ``MAX_REFRESH_STRETCH`` times; unknown figures keep it."""
    guard = ThroughputGuard(decay=1.0, min_steps=1, refresh_every=10, refresh_lead=0.2)
    assert guard.refresh_gap(8) == 10  # nothing measured yet
    guard.observe(False, 8, 8, 8e-3)  # plain: 1 ms a token
    for drafting_ms, gap in ((0.9, 10), (1 / 1.2, 10), (0.5, 50), (1 / 1.6, 30), (0.1, 80)):
        guard.observe(True, 8, 8, 8 * drafting_ms * 1e-3)
        assert guard.refresh_gap(8) == pytest.approx(gap, abs=1), drafting_ms
    assert guard.refresh_gap(64) == 10  # another bucket, nothing measured
    guard.observe(False, 8, 8, 8e-3)  # a plain step: the count starts again
    for _ in range(79):
        guard.observe(True, 8, 8, 8e-4)
    assert not guard.wants_plain(8)
    guard.observe(True, 8, 8, 8e-4)
    assert guard.wants_plain(8)
    free = ThroughputGuard(decay=1.0, min_steps=1, refresh_every=10)
    free.observe(False, 8, 8, 8e-3)
    free.observe(True, 8, 8, 0.0)  # drafting steps that took no time: the longest gap
    assert free.refresh_gap(8) == 80
    with pytest.raises(ValueError, match="refresh_lead"):
        ThroughputGuard(refresh_lead=0.0)


def test_guard_and_budget_ask_drafting_for_a_minimum_gain():
    """Drafting measured 1% faster than plain is vetoed under ``min_gain=0.02``; the veto lifts at
    4% faster (twice min_gain), not at 3%, which a bucket never vetoed allows. The budget's own
    pick needs a predicted gain of ``min_gain`` over k = 0."""
    guard = ThroughputGuard(decay=1.0, min_steps=1, min_gain=0.02)
    for batch in (64, 8):
        guard.observe(False, batch, 100, 1.0)
    guard.observe(True, 64, 101, 1.0)
    assert not guard.allows_drafting(64)
    guard.observe(True, 64, 103, 1.0)
    guard.observe(True, 8, 103, 1.0)
    assert not guard.allows_drafting(64) and guard.allows_drafting(8)
    guard.observe(True, 64, 105, 1.0)
    assert guard.allows_drafting(64)
    guard.observe(True, 64, 103, 1.0)
    assert guard.allows_drafting(64)  # lifted: back to the plain threshold
    eager = DraftBudget(synthetic_cost(2e-4, 2e-5), tracker_with_rate(0.9), [1, 2, 4, 8])
    k = eager.best(8)
    gain = eager.throughput(8, k) / eager.throughput(8, 0) - 1.0
    assert gain > 0 and k > 0
    below = DraftBudget(eager.cost, eager.tracker, [1, 2, 4, 8], min_gain=0.99 * gain)
    above = DraftBudget(eager.cost, eager.tracker, [1, 2, 4, 8], min_gain=1.01 * gain)
    assert below.best(8) > 0 and above.best(8) == 0
    with pytest.raises(ValueError, match="min_gain"):
        ThroughputGuard(min_gain=-0.1)


def test_pick_is_reused_for_a_few_calls_and_redone_when_the_batch_or_turn_changes():
    """The argmax is recomputed when the batch leaves its half-octave, else every ``reuse`` calls; in
    between, moves of acceptance or of the host model do not change the decision."""
    budget = DraftBudget(synthetic_cost(2e-4, 2e-5), tracker_with_rate(0.9), [1, 2, 4, 8])
    k = budget(8)
    assert k > 0
    budget.tracker.reset(0.0)  # no acceptance: drafting cannot pay
    picks = [budget(8) for _ in range(budget.reuse)]
    assert picks == [k] * (budget.reuse - 1) + [0]  # the stale pick lasts out its turn
    assert budget(16) == 0 and budget(8) == 0
    budget.tracker.reset(0.9)
    assert budget(7) == 0  # 7 and 8 share a half-octave: the turn goes on
    assert budget(16) == k  # a new half-octave decides afresh


def test_decisions_count_each_step_by_its_reason():
    """Every call lands in exactly one reason: drafting, the model's 0, the guard's veto, a probe."""
    guard = ThroughputGuard(min_steps=1)
    budget = DraftBudget(synthetic_cost(2e-4, 2e-5), tracker_with_rate(0.9), [4], probe_every=3, guard=guard)
    budget.record_step(8, 0, 0, 1, 1e-6, tokens=8)
    budget.record_step(8, 32, 32, 5, 1e-3, tokens=8)  # drafting measured far slower: vetoed
    picks = [budget(8) for _ in range(6)]
    assert picks == [0, 0, 4, 0, 0, 4]
    assert budget.decisions == {"vetoed": 4, "probe": 2}
    budget.tracker.reset(0.0)
    budget(16)  # another half-octave: decided afresh
    assert budget.decisions["model"] == 1 and sum(budget.decisions.values()) == 7


def test_a_grid_of_decode_steps_alone_is_interpolated_in_batch_size():
    """widths (1,) is a valid grid (decode only): every width is priced as a decode step."""
    cost = CostModel((1, 9), (1,), ((1e-3,), (2e-3,)))
    assert cost.step_time(5, 1) == pytest.approx(1.5e-3)
    assert cost.step_time(5, 8) == cost.step_time(5, 1)
    assert cost.step_time(18, 4) == pytest.approx(4e-3)  # beyond the grid: linear in B


def test_budget_refuses_negative_candidates_and_prices_only_its_candidates():
    with pytest.raises(ValueError, match=r"candidates must be >= 0, got \[2, -1\]"):
        DraftBudget(gpu_grid(), AcceptanceTracker(8), [2, -1])
    budget = DraftBudget(gpu_grid(), AcceptanceTracker(8), [2, 4])
    assert budget.step_time(8, 4) == gpu_grid().step_time(8, 5)
    with pytest.raises(ValueError, match=r"k must be one of the candidates \[0, 2, 4\], got 3"):
        budget.step_time(8, 3)
    with pytest.raises(ValueError, match="k must be one of the candidates"):
        budget.throughput(8, 3)

"""Parallel propose: the same DraftBatches and the same state left behind for every thread count.

One drafter proposes on the calling thread only, its twin splits calls over 4 threads; both see
the same operations and every proposal must match byte for byte, including calls where
``max_batch_draft_tokens`` cuts the drafts of later requests and calls smaller than the parallel
threshold.
"""
from __future__ import annotations

import gc
import os
import signal
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_spec import _core
from rollout_spec.config import SpecConfig
from rollout_spec.drafter import NgramDrafter
from rollout_spec.tree import DraftBatch
from polling import wait_until
from test_drafter_reference import (  # noqa: E402  (tests/ is on sys.path)
    as_lists, best_path, config_st, drafter_with_core, op_st)


def make_twins(cfg: SpecConfig, min_requests: int, capacity: int = 1 << 20) -> tuple[NgramDrafter, NgramDrafter]:
    """(one-thread drafter, 4-thread drafter splitting calls of >= min_requests requests)."""
    one, many = (drafter_with_core(cfg, propose_threads=threads, parallel_min_requests=min_requests,
                                   capacity_tokens=capacity) for threads in (1, 4))
    return one, many


def assert_same(a: DraftBatch, b: DraftBatch) -> None:
    """Byte-identical batches."""
    for name in ("offsets", "tokens", "parents", "probs"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), name


def propose_both(one: NgramDrafter, many: NgramDrafter, ids, budgets=None) -> DraftBatch:
    """Propose on both twins, check they agree (drafts and counters), return the batch."""
    a, b = one.propose(ids, budgets), many.propose(ids, budgets)
    assert_same(a, b)
    assert one.stats()["proposals"] == many.stats()["proposals"]
    return a


def run_ops(one: NgramDrafter, twin: NgramDrafter, ops: list,
            before: Callable[[tuple, list[int]], None] | None = None) -> None:
    """Apply the reference test's operations to both drafters; every proposal must agree
    (``propose_both``). ``before(op, live)`` runs ahead of each operation, on the live ids."""
    live: list[int] = []
    next_id = 0
    for op in ops:
        if before is not None and live:
            before(op, live)
        if op[0] == "start":
            for d in (one, twin):
                d.start(next_id, op[1], op[2])
            live.append(next_id)
            next_id += 1
        elif op[0] == "extend" and live:
            for d in (one, twin):
                d.extend(live[op[1] % len(live)], op[2])
        elif op[0] == "finish" and live:
            rid = live.pop(op[1] % len(live))
            for d in (one, twin):
                d.finish(rid)
        elif op[0] == "propose" and live:
            ids = live[op[1] % len(live):]
            propose_both(one, twin, ids, [op[2]] * len(ids))
        elif op[0] == "accept" and live:
            # Propose for everyone (the cap binds often), then commit one request's best path.
            batch = propose_both(one, twin, live)
            k = op[1] % len(live)
            path = best_path(as_lists(batch)[k])[:op[2]] + ([op[3]] if op[3] >= 0 else [])
            for d in (one, twin):
                d.extend(live[k], path)
        elif op[0] == "add":
            for d in (one, twin):
                d.add_sequences([op[1]], [op[2]])
        elif op[0] == "end_step":
            for d in (one, twin):
                d.end_step()
    if live:
        propose_both(one, twin, live)
    twin.check_integrity()


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=config_st, ops=st.lists(op_st, min_size=1, max_size=40), capacity=st.integers(20, 80))
def test_random_operations_match_one_thread(cfg, ops, capacity):
    """The reference test's operations (tiny batches, caps of 0-20 nodes), every call of two or
    more requests split over the pool."""
    run_ops(*make_twins(cfg, min_requests=2, capacity=capacity), ops)


@pytest.mark.parametrize("tree,cap,keyed", [(True, 1 << 20, False), (True, 700, False), (False, 700, False),
                                            (True, 700, True)])
def test_engine_like_steps_at_batch_256_match_one_thread(tree, cap, keyed):
    """256 live requests in groups of 8 with the default threshold: full calls on the pool with
    uneven budgets (cap 700 binds part-way through every full call), and calls below it. Keyed:
    race-aware trees (most of the requests told their noise keys) must be cut by the cap exactly
    as on one thread, so their nodes too come out in one fixed order whatever the budget."""
    rng = np.random.default_rng(7)
    cfg = SpecConfig(tree=tree, num_draft_tokens=8, max_batch_draft_tokens=cap)
    one, many = make_twins(cfg, min_requests=64)
    ids = list(range(256))
    motifs = [rng.integers(0, 40, 30).tolist() for _ in range(32)]
    prompts = [motifs[i // 8][: 10 + i % 8] for i in ids]
    for d in (one, many):
        d.start_batch(ids, prompts, [i // 8 for i in ids])
        if keyed:
            d.set_noise_keys(ids, [None if i % 5 == 0 else 1000 + i for i in ids],
                             [0.6 + (i % 3) * 0.2 for i in ids], 40)
    cut = 0
    for step in range(40):
        budgets = rng.integers(0, 13, len(ids)) if step % 3 else None
        batch = propose_both(one, many, ids, budgets)
        sizes = batch.sizes()
        cut += int(sizes[-64:].sum() == 0)  # the cap left the last requests without drafts
        propose_both(one, many, ids[step % 8::8])  # 32 requests: below the threshold
        trees = as_lists(batch)
        commits = []
        for i in ids:
            # Accept a random prefix of the best path, then a bonus that mostly follows the motif.
            path = best_path(trees[i])[: rng.integers(0, 5)]
            bonus = motifs[i // 8][(step + i) % 30] if rng.random() < 0.7 else rng.integers(0, 40)
            commits.append(path + [int(bonus)])
        for d in (one, many):
            d.extend_batch(ids, commits)
    assert one.stats()["proposals"] > 0
    assert (cut > 0) == (cap < 1 << 20)
    many.check_integrity()


@pytest.mark.parametrize("background", [False, True])
def test_split_indexing_matches_one_thread(background):
    """extend_batch of 96 requests is indexed on the pool (the global index on one thread, the
    request and group indexes by group on the others): grouped requests, ungrouped ones, some
    with nothing new, long commits crossing many positions. Every proposal, the stats and the
    integrity check must come out as on one thread, also after eviction under a small capacity."""
    rng = np.random.default_rng(11)
    one, many = make_twins(SpecConfig(num_draft_tokens=8), min_requests=16, capacity=3000)
    ids = list(range(96))
    groups = [i // 8 if i < 64 else None for i in ids]
    motifs = [rng.integers(0, 30, 40).tolist() for _ in range(12)]
    for d in (one, many):
        d.start_batch(ids, [motifs[i % 12][: 6 + i % 9] for i in ids], groups)
    for step in range(30):
        commits = []
        for i in ids:
            size = 0 if (i + step) % 7 == 0 else int(rng.integers(1, 12))
            start = (step * 3 + i) % 30
            toks = motifs[i % 12][start:start + size]
            commits.append([int(t) if rng.random() < 0.8 else int(rng.integers(0, 30)) for t in toks])
        for d in (one, many):
            d.extend_batch(ids, commits, background=background)
        propose_both(one, many, ids)
        if step % 10 == 9:
            done = ids[:16]
            ids = ids[16:] + [i + 1000 for i in done]
            for d in (one, many):
                d.finish_batch(done)
                d.start_batch(ids[-16:], [motifs[i % 12][:8] for i in ids[-16:]], [i % 5 for i in ids[-16:]])
                d.end_step()
    assert one.stats() == many.stats()
    one.check_integrity()
    many.check_integrity()


def test_propose_threads_is_validated():
    """Out-of-range thread counts are refused by the config and by the core, naming the field."""
    for bad in (-1, 257):
        with pytest.raises(ValueError, match=r"propose_threads.*\[0, 256\]|propose_threads.*256"):
            SpecConfig(propose_threads=bad)
        core_cfg = _core.CoreConfig()
        core_cfg.propose_threads = bad
        with pytest.raises(ValueError, match="propose_threads"):
            _core.DrafterCore(core_cfg)
    assert SpecConfig(propose_threads=0).propose_threads == 0  # auto


def os_thread_count() -> int:
    """Threads of this process as the OS counts them: the core's pool threads are native, so
    ``threading`` does not see them."""
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux's /proc")
def test_many_pooled_drafters_come_and_go():
    """Cores with pools are made and dropped repeatedly (threads are joined, none leak or hang)."""
    gc.collect()  # earlier tests' unreachable drafters: their pools must not end during this one
    before = os_thread_count()
    for k in range(20):
        one, many = make_twins(SpecConfig(), min_requests=2)
        ids = list(range(8))
        for d in (one, many):
            d.start_batch(ids, [[i, k, 1, 2, i, k] for i in ids], [0] * 8)
        propose_both(one, many, ids)
        if k == 0:
            assert os_thread_count() > before  # the pool is running, so a leak would show
        del one, many, d  # d: the loop's last drafter
    assert os_thread_count() <= before


def _wait_for_child(pid: int, what: str) -> tuple[int, int]:
    """``os.waitpid``'s answer once the forked child ``pid`` exited; a child still running after
    60 s is killed (it must not outlive the test) and the test fails with ``what``."""
    try:
        return wait_until(lambda: os.waitpid(pid, os.WNOHANG), what, until=lambda done: done != (0, 0),
                          timeout_s=60.0)
    except AssertionError:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_proposes_on_a_fresh_pool():
    """A child forked after the pool started (as multiprocessing and Ray workers do) has none of
    its threads; its large proposals must still complete, and match the parent's."""
    one, many = make_twins(SpecConfig(), min_requests=2)
    ids = list(range(16))
    for d in (one, many):
        d.start_batch(ids, [[i % 3, 1, 2, i % 3, 1] for i in ids], [0] * 16)
    propose_both(one, many, ids)  # the pool exists now
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: report the draft's bytes, never return into pytest
        try:
            os.write(write_end, many.propose(ids).tokens.tobytes())
        finally:
            os._exit(0)
    os.close(write_end)
    _wait_for_child(pid, "the forked child's propose hung")
    with os.fdopen(read_end, "rb") as f:
        got = f.read()
    assert got and got == one.propose(ids).tokens.tobytes()


def test_a_fork_waits_for_background_work():
    """Forked right after a background extend was queued, the child's first call returns (it
    copied the queued job's count, not the core's thread, and waited for it forever), and it
    holds the extended tokens."""
    rng = np.random.default_rng(0)
    d = NgramDrafter(SpecConfig(propose_threads=1))
    ids = list(range(512))
    d.start_batch(ids, [rng.integers(0, 50_000, 200).tolist() for _ in ids])
    d.extend_batch(ids, [rng.integers(0, 50_000, 400).tolist() for _ in ids], background=True)
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        try:
            d.check_integrity()
            os._exit(0 if d.stats()["index_tokens"] >= 512 * 600 else 3)
        finally:
            os._exit(2)
    _, status = _wait_for_child(pid, "the forked child's first call hung")
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0

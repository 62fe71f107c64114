"""A drafter survives a fork: the child can use it and free it.

A forked child has none of the parent's threads, but its copies of their mutexes and condition
variables may still count them as waiters; destroying one then blocked the child for good (a
child that freed a drafter whose background thread or propose pool had been started hung), and a
fork may come while another thread is inside a drafter call (the fork waits for it).
"""
from __future__ import annotations

import gc
import os
import signal
import threading

import numpy as np
import pytest

from rollout_spec import SpecConfig
from rollout_spec.drafter import NgramDrafter

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

CHILD_SECONDS = 20  # a child still running then is stuck: SIGALRM ends it


def _drafter_with_threads(threads: int, background: bool) -> tuple[NgramDrafter, list[int]]:
    """A drafter whose background worker (``background``) and pool (threads > 1) are running."""
    d = NgramDrafter(SpecConfig(propose_threads=threads))
    ids = list(range(100))  # enough requests for a propose to be split over the pool
    rng = np.random.default_rng(0)
    d.start_batch(ids, [rng.integers(0, 50, 30).tolist() for _ in ids])
    d.extend_batch(ids, [[1, 2]] * len(ids), background=background)
    d.propose(ids)  # waits for the background job, so none is pending at the fork
    return d, ids


def _trees(d: NgramDrafter, ids: list[int]) -> tuple[list[int], ...]:
    """A proposal's arrays, comparable with ==."""
    batch = d.propose(ids)
    return tuple(a.tolist() for a in (batch.offsets, batch.tokens, batch.parents, batch.probs))


def _run_in_child(child) -> int:
    """Fork, run ``child()`` there under an alarm, and return how the child ended (its exit
    status, or -signal)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child's coverage is not collected
        code = 1
        try:
            signal.alarm(CHILD_SECONDS)
            child()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


@pytest.mark.parametrize("threads, background", [(1, True), (4, False), (4, True)])
@pytest.mark.parametrize("use_in_child", [False, True], ids=["free", "use-then-free"])
def test_a_forked_child_can_use_and_free_the_drafter(threads, background, use_in_child):
    d, ids = _drafter_with_threads(threads, background)
    expected = _trees(d, ids)

    def child() -> None:
        nonlocal d
        if use_in_child:
            assert _trees(d, ids) == expected
            d.extend_batch(ids, [[3]] * len(ids), background=True)
            d.propose(ids)
        del d
        gc.collect()

    assert _run_in_child(child) == 0, "the child hung (SIGALRM) or failed"
    assert _trees(d, ids) == expected  # the parent's threads are untouched


def test_a_fork_while_other_threads_use_the_drafter_gives_the_child_a_whole_one():
    """A fork waits for the calls and background jobs in progress: a child forked while another
    thread starts, extends (in the background), drafts ahead, proposes and finishes requests gets
    an unlocked drafter whose state passes the integrity check (it used to inherit a held lock,
    and block at its first call, or a half-done indexing)."""
    d = NgramDrafter(SpecConfig(propose_threads=2, capacity_tokens=20_000))  # a small state
    rng = np.random.default_rng(1)
    stop = threading.Event()
    errors: list[BaseException] = []

    def keep_busy() -> None:
        try:
            first = 0
            while not stop.is_set():
                ids = list(range(first, first + 64))
                first += 64
                d.start_batch(ids, rng.integers(0, 50, (len(ids), 40)).tolist(), group_ids=[i // 8 for i in ids])
                for _ in range(4):
                    d.extend_batch(ids, rng.integers(0, 50, (len(ids), 3)).tolist(), background=True)
                    d.propose_ahead(ids)
                    d.propose(ids)
                d.finish_batch(ids)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    def child() -> None:
        signal.alarm(5)  # a child that inherited a held lock blocks at its first call
        d.check_integrity()
        ids = [1 << 40, (1 << 40) + 1]  # ids the busy thread never reaches
        d.start_batch(ids, [[1, 2, 3, 1, 2]] * 2)
        d.extend_batch(ids, [[3, 1]] * 2, background=True)
        assert d.propose(ids).tokens.tolist()[:1] == [2]  # the prompt's own continuation
        d.check_integrity()

    busy = threading.Thread(target=keep_busy)
    busy.start()
    try:
        endings = [_run_in_child(child) for _ in range(20)]
    finally:
        stop.set()
        busy.join()
    assert not errors
    assert endings == [0] * 20, "a child hung (SIGALRM) or found the drafter broken"
    d.check_integrity()

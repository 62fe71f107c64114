"""Scheduler admission: whole prompts where slots allow, batched once samples are running."""

from __future__ import annotations

from rollout_spec.config import SamplingParams
from rollout_spec.engine.scheduler import Scheduler
from rollout_spec.engine.sequence import Sequence


def queue(sched: Scheduler, prompts: int, n: int) -> list[Sequence]:
    seqs = [Sequence(p * n + i, p, i, [1, 2, 3], SamplingParams(n=n), p, frozenset(), 0)
            for p in range(prompts) for i in range(n)]
    for s in seqs:
        sched.add(s)
    return seqs


def finish(sched: Scheduler, count: int) -> None:
    for s in sched.running[:count]:
        s.finish_reason = "stop"
    sched.release_finished()


def test_admission_waits_for_min_admit_free_slots_while_samples_run() -> None:
    sched = Scheduler(num_slots=16, max_prefill_tokens=1 << 20)
    assert sched.min_admit == 2
    queue(sched, prompts=3, n=8)
    assert [len(g) for g in sched.admit()] == [8, 8]  # nothing runs yet: fill every slot
    finish(sched, 1)
    assert sched.admit() == [] and len(sched.free_slots) == 1  # one free slot: keep decoding
    finish(sched, 1)
    assert [len(g) for g in sched.admit()] == [2]  # two free: one prefill for both
    finish(sched, 15)
    assert [len(g) for g in sched.admit()] == [6]  # the rest of the queue fits: admit it


def test_last_waiting_sample_is_admitted_into_one_free_slot() -> None:
    sched = Scheduler(num_slots=16, max_prefill_tokens=1 << 20, min_admit=4)
    queue(sched, prompts=1, n=17)
    assert [len(g) for g in sched.admit()] == [16]
    finish(sched, 1)
    assert [len(g) for g in sched.admit()] == [1]  # fewer wait than min_admit: no reason to wait

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


def test_prefill_bound_splits_admissions_and_always_admits_one_group() -> None:
    """Groups join a prefill while groups x longest prompt stays within max_prefill_tokens; a
    group over the bound on its own is still admitted alone (a long prompt cannot starve), and
    every running sample holds its own slot, freed slots going to the next admitted ones."""
    sched = Scheduler(num_slots=8, max_prefill_tokens=40, min_admit=1)
    seqs = [Sequence(i, i // 2, i % 2, [1] * length, SamplingParams(n=2), None, frozenset(), 0)
            for i, length in enumerate([10, 10, 20, 20, 50, 50, 5, 5])]
    for s in seqs:
        sched.add(s)
    assert [[s.req_id for s in g] for g in sched.admit()] == [[0, 1], [2, 3]]  # 2 x 20 <= 40
    assert [[s.req_id for s in g] for g in sched.admit()] == [[4, 5]]  # 50 > 40, alone
    assert [[s.req_id for s in g] for g in sched.admit()] == [[6, 7]]
    assert sorted(s.slot for s in seqs) == list(range(8))
    first_slots = {s.req_id: s.slot for s in seqs}
    finish(sched, 2)  # samples 0 and 1 end: their slots are free again, theirs are -1
    assert [s.slot for s in seqs[:2]] == [-1, -1]
    late = [Sequence(8 + i, 4, i, [1, 2], SamplingParams(n=2), None, frozenset(), 0) for i in range(2)]
    for s in late:
        sched.add(s)
    assert [[s.req_id for s in g] for g in sched.admit()] == [[8, 9]]
    assert {s.slot for s in late} == {first_slots[0], first_slots[1]}
    assert len({s.slot for s in sched.running}) == len(sched.running) == 8

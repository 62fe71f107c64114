"""Group-sticky routing, stable keys and bucket packing (no Ray needed)."""
from __future__ import annotations

import hashlib
import subprocess
import sys

import numpy as np
import pytest

from rollout_spec.distributed import GroupRouter, group_key
from rollout_spec.distributed.coordinator import IndexCoordinator
from rollout_spec.distributed.packing import pack, split_by_destination, unpack


def test_group_key_is_stable_across_processes() -> None:
    code = "from rollout_spec.distributed import group_key; print(group_key('uid-42'), group_key([5, 6, 7]))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert [int(x) for x in out] == [group_key("uid-42"), group_key([5, 6, 7])]
    expected = int.from_bytes(hashlib.blake2b(b"uid-42", digest_size=8).digest(), "little") & ((1 << 31) - 1)
    assert group_key("uid-42") == expected
    assert group_key(12345) == 12345  # framework int ids keep their meaning for the drafter
    assert group_key(np.array([5, 6, 7])) == group_key((5, 6, 7))


def test_group_key_matches_the_engine_adapters_prompt_groups() -> None:
    """The router must send a prompt where the engine-side drafter files its samples."""
    from rollout_spec.groups import prompt_group_id
    from rollout_spec.integrations.vllm.chains import explicit_group_id

    prompt = [1, 50, 4000, 2**20]
    assert group_key(prompt) == prompt_group_id(prompt)
    assert group_key("uid-7") == explicit_group_id("uid-7")
    odd = "é\ud800"  # a lone surrogate, as text decoded with surrogateescape carries
    assert group_key(odd) == explicit_group_id(odd) == group_key(odd.encode("utf-8", "surrogatepass"))


@pytest.mark.parametrize("bad, exc", [(None, TypeError), (True, TypeError), (-1, ValueError), (1.5, TypeError)])
def test_group_key_rejects_bad_ids(bad: object, exc: type) -> None:
    with pytest.raises(exc, match="group id"):
        group_key(bad)


@pytest.mark.parametrize(
    "kwargs, field", [({"num_replicas": 0}, "num_replicas"), ({"num_replicas": 4, "load_factor": 0.5}, "load_factor"),
                      ({"num_replicas": 4, "slack": -1}, "slack")]
)
def test_router_validates_arguments(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        GroupRouter(**kwargs)


def test_preferences_are_a_deterministic_permutation_prefix() -> None:
    a, b = GroupRouter(16), GroupRouter(16)
    prefs = a.preferences(list(range(500)), 16)
    assert (prefs == b.preferences(list(range(500)), 16)).all()
    assert all(sorted(row) == list(range(16)) for row in prefs.tolist())
    assert (a.preferences(list(range(500)), 3) == prefs[:, :3]).all()
    firsts = np.bincount(prefs[:, 0], minlength=16)
    assert firsts.min() > 10  # every replica is somebody's first choice (500/16 ~ 31 each)
    assert not (GroupRouter(16, seed=1).preferences(list(range(500)), 1)[:, 0] == prefs[:, 0]).all()


def test_adding_a_replica_moves_about_one_group_in_n() -> None:
    keys = list(range(4000))
    before = GroupRouter(20).preferences(keys, 1)[:, 0]
    after = GroupRouter(21).preferences(keys, 1)[:, 0]
    moved = before != after
    assert (after[moved] == 20).all()  # groups only move to the newcomer
    assert 0.02 < moved.mean() < 0.08  # ~1/21


def test_assign_keeps_groups_whole_and_load_bounded() -> None:
    router = GroupRouter(8, load_factor=1.1, slack=0)
    groups = [f"prompt-{i}" for i in range(64)]
    placed = router.assign(groups, weights=[8] * 64)
    load = np.bincount(placed, weights=[8] * 64, minlength=8)
    assert load.max() <= router.capacity(512) and load.sum() == 512
    assert (router.assign(groups, weights=[8] * 64) == placed).all()  # same step again: same places
    shuffled = groups[::-1]
    assert (router.assign(shuffled, weights=[8] * 64) == placed[::-1]).all()  # order does not matter
    unbounded = GroupRouter(8, load_factor=16.0).assign(groups, weights=[8] * 64)
    assert (unbounded == router.preferences(groups, 1)[:, 0]).all()  # without pressure: first choice


def test_acquire_is_sticky_until_the_replica_is_full() -> None:
    router = GroupRouter(4, load_factor=1.0, slack=2)
    first = [router.acquire("g") for _ in range(3)]
    assert first[0] == first[1] == first[2]
    for _ in range(3):
        router.acquire("other")
    overflow = router.acquire("g")  # 7 in flight, cap ceil(7/4)+2 = 4: "g"'s replica holds 3 -> stays
    assert overflow == first[0]
    spilled = router.acquire("g")  # now it holds 4 = cap: the group spills to its next choice
    assert spilled != first[0] and spilled == router.preferences(["g"], 2)[0, 1]
    router.release(first[0])
    assert router.inflight().sum() == 7
    with pytest.raises(ValueError, match="replica"):
        GroupRouter(2).release(0)


def test_a_removed_replicas_groups_move_and_the_others_stay() -> None:
    """With replica 3 down the bound is over the three left: assign stays under it, and a step of
    64 groups x 8 samples acquired one at a time splits no more groups than with all four up."""
    router = GroupRouter(4, load_factor=1.0, slack=0)
    router.set_available(3, False)
    placed = router.assign(range(1000))
    assert 3 not in placed and np.bincount(placed).max() <= router.capacity(1000) == 334

    def split_groups(down: tuple[int, ...]) -> int:
        sticky = GroupRouter(4)
        for replica in down:
            sticky.set_available(replica, False)
        places: dict[int, set[int]] = {}
        for group in range(64):
            for _ in range(8):
                places.setdefault(group, set()).add(sticky.acquire(group))
        return sum(len(p) > 1 for p in places.values())

    assert split_groups((3,)) <= split_groups(())


def test_pack_roundtrip_and_split_by_destination() -> None:
    seqs = [np.array([1, 2, 3]), np.array([], np.int64), np.array([9])]
    groups = np.array([7, 8, 9], np.int64)
    assert unpack(pack(groups, seqs)) == ([7, 8, 9], [[1, 2, 3], [], [9]])
    dests = np.array([[0, 2], [2, 1], [1, 0]], np.int32)
    buckets = split_by_destination(groups, seqs, dests)
    assert sorted(buckets) == [0, 1, 2]
    assert unpack(buckets[0]) == ([7, 9], [[1, 2, 3], [9]])
    assert unpack(buckets[2]) == ([7, 8], [[1, 2, 3], []])
    with pytest.raises(ValueError, match="differ in length"):
        pack([1], [])
    with pytest.raises(ValueError, match="groups must hold integers in"):
        pack([2**31], [np.arange(2)])
    broken = pack(groups, seqs)
    broken[4] += 1  # a length that no longer matches the tokens
    with pytest.raises(ValueError, match="corrupt bucket"):
        unpack(broken)


def test_coordinator_keeps_only_recent_steps() -> None:
    coord = IndexCoordinator(retain_steps=2)
    for step in range(4):
        parts = [pack([step], [np.arange(3)]), pack([step], [np.arange(5)])]
        coord.publish(0, step, [1, 2], [len(p) for p in parts], np.concatenate(parts))
    got = coord.pull(1, -1)
    assert got.head == 4 and got.latest_step == 3 and [e.step for e in got.entries] == [2, 3]
    assert [unpack(b) for b in got.buckets()] == [([2], [[0, 1, 2]]), ([3], [[0, 1, 2]])]
    assert [e.step for e in coord.pull(1, 3).entries] == [3]  # a cursor skips what was already seen
    assert coord.pull(1, -1, budget_tokens=4).over_budget == 1  # newest first under the budget
    assert coord.stats()["tokens"] == 2 * (3 + 5)
    coord.publish(1, 3, [1], [5], pack([9], [np.arange(2)]))
    assert [e.src for e in coord.pull(1, -1).entries] == [0, 0]  # its own: only when catching up
    assert [e.src for e in coord.pull(1, -1, own_steps=[]).entries] == [0, 0, 1]
    assert [e.src for e in coord.pull(1, -1, own_steps=[3]).entries] == [0, 0]
    with pytest.raises(ValueError, match="differ in length"):
        coord.publish(0, 5, [1], [4, 4], np.zeros(8, np.int32))
    with pytest.raises(ValueError, match="payload"):
        coord.publish(0, 5, [1], [4], np.zeros(5, np.int32))


def test_assign_and_acquire_refuse_what_they_cannot_place() -> None:
    router = GroupRouter(3)
    with pytest.raises(ValueError, match=r"weights must hold one int per group \(2\), got 3"):
        router.assign([1, 2], weights=[1, 1, 1])
    with pytest.raises(ValueError, match=r"base_load must hold one int per replica \(3\), got 2"):
        router.assign([1, 2], base_load=[0, 0])
    for replica in range(3):
        router.set_available(replica, False)
    with pytest.raises(RuntimeError, match="no replica is available"):
        router.assign([1])
    with pytest.raises(RuntimeError, match="no replica is available"):
        router.acquire(1)
    assert router.inflight().tolist() == [0, 0, 0]


def test_a_group_with_no_preference_under_capacity_goes_to_the_least_loaded() -> None:
    """Base loads above every replica's room: the heavy group is not kept on its first choice."""
    router = GroupRouter(3, load_factor=1.0, slack=0)
    prefs = router.preferences([7], 3)[0]
    base = np.zeros(3, np.int64)
    base[prefs] = [6, 5, 4]  # cap = max(ceil(19 / 3), 4) = 7: none has room for 4 more
    assert router.assign([7], weights=[4], base_load=base).tolist() == [prefs[2]]


def test_acquire_remembers_only_the_most_recent_groups() -> None:
    router = GroupRouter(2, max_sticky_groups=2)
    for group in ("a", "b", "c"):
        router.acquire(group)
    assert router.clear_sticky() == 2 and router.inflight().sum() == 3

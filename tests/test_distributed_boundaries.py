"""Boundaries of the router, the keys and the coordinator: a single group passed as a batch, seeds
that differ in their low bits, capacities at whole multiples of the mean, steps older than the
retention window (no Ray needed)."""
from __future__ import annotations

import numpy as np
import pytest

from rollout_spec.distributed import GroupRouter, group_keys
from rollout_spec.distributed.coordinator import IndexCoordinator
from rollout_spec.distributed.keys import mix64
from rollout_spec.distributed.packing import pack


@pytest.mark.parametrize("call", [
    lambda: group_keys("uid-7"),
    lambda: group_keys(b"uid-7"),
    lambda: GroupRouter(4).assign("uid-7"),
    lambda: GroupRouter(4).preferences(b"ab", 2),
    lambda: GroupRouter(4).assign(7),
    lambda: group_keys(None),
])
def test_a_single_str_or_bytes_is_not_taken_as_a_batch_of_groups(call) -> None:
    """Iterated, "uid-7" would be five groups "u", "i", ... and b"ab" the int groups 97 and 98;
    one int group (or None) is refused naming ``groups``, not with Python's "not iterable"."""
    with pytest.raises(TypeError, match="groups"):
        call()
    assert GroupRouter(4).assign(["uid-7"]).shape == (1,) and group_keys([b"ab"]).shape == (1,)


def test_a_seed_reshuffles_the_ranking_instead_of_shifting_the_replica_indices() -> None:
    """Seeds 1..N-1 used to salt replica i like seed 0 salted replica i +- a few, so each group's
    first choice was seed 0's moved by a constant: two routers with nearby seeds hot-spotted alike."""
    keys = list(range(20_000))
    base = GroupRouter(64).preferences(keys, 1)[:, 0].astype(np.int64)
    for seed in (1, 2, 3, 5, 40):
        firsts = GroupRouter(64, seed=seed).preferences(keys, 1)[:, 0].astype(np.int64)
        _, counts = np.unique((firsts - base) % 64, return_counts=True)
        assert counts.max() / len(keys) < 0.05, seed  # independent rankings: ~1/64 per shift
    # seed 0 (every hook's) keeps its ranking: the salts it always had
    salts = mix64(np.arange(64, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15))
    scores = mix64(mix64(np.arange(500, dtype=np.uint64))[:, None] ^ salts[None, :])
    assert (GroupRouter(64).preferences(list(range(500)), 64) == np.argsort(scores, axis=1)[:, ::-1]).all()


def test_capacity_is_the_ceiling_of_the_load_factor_times_the_mean() -> None:
    """1.1 is stored as 1.1000000000000000888, so 1.1 x 10 came out as 11.000000000000002 and the
    ceiling as 12: a replica could take 20 % above the mean under the default load factor."""
    router = GroupRouter(10, slack=0)
    assert [router.capacity(t) for t in (100, 101, 1000, 0)] == [11, 12, 110, 0]
    assert GroupRouter(4, load_factor=1.0, slack=0).capacity(1000) == 250
    placed = router.assign(list(range(100)))
    assert np.bincount(placed, minlength=10).max() <= 11


def _publish(coord: IndexCoordinator, src: int, step: int, dest: int = 1) -> None:
    bucket = pack([7], [np.arange(3)])
    coord.publish(src, step, [dest], [len(bucket)], bucket)


def test_steps_older_than_the_window_are_not_kept() -> None:
    coord = IndexCoordinator(retain_steps=1)
    _publish(coord, 0, 5)
    _publish(coord, 2, 3)  # a publisher two steps behind: step 3 is already out of the window
    assert [(e.src, e.step) for e in coord.pull(1, -1).entries] == [(0, 5)]
    assert coord.stats()["entries"] == 1 and coord.stats()["stale_publishes"] == 1
    _publish(coord, 2, 5)  # the newest step itself is kept, whoever publishes it
    assert [(e.src, e.step) for e in coord.pull(1, -1).entries] == [(0, 5), (2, 5)]


def test_steps_numbered_from_zero_again_do_not_pile_up() -> None:
    """A coordinator that saw step 100 (a detached one reused, a client numbering its own steps)
    used to keep every later publication of steps 0, 1, ... until one passed 100."""
    coord = IndexCoordinator(retain_steps=2)
    _publish(coord, 0, 100)
    for step in range(50):
        _publish(coord, 0, step)
    assert coord.stats()["entries"] == 1 and coord.stats()["latest_step"] == 100
    assert [e.step for e in coord.pull(1, -1).entries] == [100]
    assert coord.publish(0, 101, [], [], np.zeros(0, np.int32)) == 52  # the head still counts every publish

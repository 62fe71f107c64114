"""Group-sticky routing with bounded load: the n samples of a prompt, and that prompt at later RL
steps, go to one replica unless it is already carrying more than its share.

Each group ranks the replicas by rendezvous hashing (``keys.rendezvous_scores``); a group takes its
first choice that still has room under ``load_factor`` times the mean load. The same ranking tells
the shared index (``shared_index.py``) which replicas should hold a group's history.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

from rollout_spec.config import check_float, check_int
from rollout_spec.distributed.keys import group_key, group_keys, rendezvous_scores
from rollout_spec.groups import GROUP_ID_MAX
from rollout_spec.token_ids import int_array

_CANDIDATES = 8  # preferences examined before falling back to the least-loaded replica
_FULL = np.int64(1) << 60  # the load an unavailable replica is treated as having
_MAX_LOAD = 1 << 32  # per group weight and per replica base load: sums stay far below _FULL


class GroupRouter:
    """Maps group ids to replica indices ``0..num_replicas-1``: sticky by group, balanced by load.

    Two ways to use it: :meth:`assign` places a whole batch at once (OpenRLHF hands each engine a
    list of prompts); :meth:`acquire`/:meth:`release` place requests one at a time as they start
    and finish (verl's async server manager).

    Args:
        num_replicas: how many rollout replicas there are, in [1, 65536].
        load_factor: a replica takes at most ``ceil(load_factor * mean load) + slack`` requests,
            in [1, 16]; 1 is strict balance, larger keeps more groups on their first choice.
        slack: extra requests a replica may hold above that bound, in [0, 1<<20], so the first
            samples of a step do not scatter a group before the mean has grown.
        seed: salts the ranking (two routers agree only if they share it).
        max_sticky_groups: groups remembered by :meth:`acquire` (least recently used forgotten).
    """

    def __init__(
        self,
        num_replicas: int,
        load_factor: float = 1.1,
        slack: int = 8,
        seed: int = 0,
        max_sticky_groups: int = 100_000,
    ) -> None:
        self.num_replicas = check_int("num_replicas", num_replicas, 1, 1 << 16)
        self.load_factor = check_float("load_factor", load_factor, 1.0, 16.0)
        # the decimal the caller wrote: float 1.1 is 1.1000000000000000888, and 1.1 x 10 must be 11, not 12
        self._load_ratio = Fraction(repr(self.load_factor)).as_integer_ratio()
        self.slack = check_int("slack", slack, 0, 1 << 20)
        self.seed = check_int("seed", seed, 0, 2**63 - 1)
        self.max_sticky_groups = check_int("max_sticky_groups", max_sticky_groups, 1, 1 << 30)
        self._inflight = np.zeros(self.num_replicas, np.int64)
        self._down = np.zeros(self.num_replicas, bool)  # removed replicas: never chosen
        self._sticky: OrderedDict[int, int] = OrderedDict()

    def preferences(self, groups: Sequence[object] | np.ndarray, k: int) -> np.ndarray:
        """The ``k`` replicas each group prefers, best first: int32[G, k] (k capped at N)."""
        k = min(check_int("k", k, 1, 1 << 16), self.num_replicas)
        keys = _as_keys(groups)
        if len(keys) == 0:
            return np.zeros((0, k), np.int32)
        scores = rendezvous_scores(keys, self.num_replicas, self.seed)
        if k < self.num_replicas:  # partition first: O(N) per group instead of a full sort
            part = np.argpartition(scores, self.num_replicas - k, axis=1)[:, -k:]
        else:
            part = np.broadcast_to(np.arange(k), scores.shape)
        order = np.argsort(np.take_along_axis(scores, part, axis=1), axis=1)[:, ::-1]
        return np.take_along_axis(part, order, axis=1).astype(np.int32)

    def capacity(self, total_load: int) -> int:
        """Most requests one replica may hold when ``total_load`` (an int >= 0) are spread over the
        available replicas (a removed one's share goes to the others, not to nobody)."""
        total_load = check_int("total_load", total_load, 0)
        available = max(self.num_replicas - int(self._down.sum()), 1)
        num, den = self._load_ratio
        return -(-num * total_load // (den * available)) + self.slack  # ceil, in exact integers

    def assign(
        self,
        groups: Sequence[object] | np.ndarray,
        weights: Sequence[int] | None = None,
        base_load: Sequence[int] | None = None,
    ) -> np.ndarray:
        """Place a batch of groups: replica index per group, int32[G].

        ``weights`` (default 1 each) is the number of requests a group brings, e.g. its n;
        ``base_load`` (default 0) is what each replica already runs; both are ints in
        ``[0, 2**32]``. Heavy groups are placed first; each takes its first preference with room
        for it under ``capacity(total)`` (or under its own weight, for a group heavier than that),
        else the least-loaded replica. A group is never split, so a replica can end above the
        capacity: by at most the weight of a group that found no preference with room, or by what
        its base load alone exceeds it.
        """
        keys = _as_keys(groups)
        w = np.ones(len(keys), np.int64) if weights is None else int_array("weights", weights, 0, _MAX_LOAD)
        if w.shape != keys.shape:
            raise ValueError(f"weights must hold one int per group ({len(keys)}), got {len(w)}")
        base = np.zeros(self.num_replicas, np.int64) if base_load is None else int_array(
            "base_load", base_load, 0, _MAX_LOAD)
        if base.shape != (self.num_replicas,):
            raise ValueError(f"base_load must hold one int per replica ({self.num_replicas}), got {len(base)}")
        w, base = w.astype(np.int64, copy=False), base.astype(np.int64, copy=False)
        if self._down.all():
            raise RuntimeError("no replica is available")
        cap = max(self.capacity(int(w.sum() + base.sum())), int(w.max(initial=0)))
        prefs = self.preferences(keys, _CANDIDATES)
        load = np.where(self._down, _FULL, base)
        out = np.empty(len(keys), np.int32)
        # heaviest first; ties by key, so the placement does not depend on the batch's order
        for g in np.lexsort((keys, -w)):
            out[g] = self._first_with_room(prefs[g], load, cap - w[g])
            load[out[g]] += w[g]
        return out

    def acquire(self, group: object) -> int:
        """Pick a replica for one request of ``group`` and count it in flight there.

        A group stays where its last request went while that replica is under capacity; then it
        takes its first preference with room. Call :meth:`release` when the request finishes.
        """
        key = group_key(group)
        if self._down.all():
            raise RuntimeError("no replica is available")
        cap = self.capacity(int(self._inflight.sum()) + 1)
        load = np.where(self._down, _FULL, self._inflight)
        replica = self._sticky.get(key)
        if replica is None or load[replica] >= cap:
            replica = self._first_with_room(self.preferences([key], _CANDIDATES)[0], load, cap - 1)
        self._sticky[key] = replica
        self._sticky.move_to_end(key)
        while len(self._sticky) > self.max_sticky_groups:
            self._sticky.popitem(last=False)
        self._inflight[replica] += 1
        return int(replica)

    def hold(self, replica: int) -> None:
        """Count one request in flight on ``replica`` chosen elsewhere (a multi-turn request's
        later turn, kept on its first server); pairs with :meth:`release`."""
        replica = check_int("replica", replica, 0, self.num_replicas - 1)
        self._inflight[replica] += 1

    def release(self, replica: int) -> None:
        """Mark one request on ``replica`` finished (pairs with :meth:`acquire`)."""
        replica = check_int("replica", replica, 0, self.num_replicas - 1)
        if self._inflight[replica] == 0:
            raise ValueError(f"replica {replica} has no request in flight to release")
        self._inflight[replica] -= 1

    def reset_load(self, replica: int) -> None:
        """Forget the requests counted in flight on ``replica`` (its server left or came back:
        the releases of what it held no longer reach this router)."""
        replica = check_int("replica", replica, 0, self.num_replicas - 1)
        self._inflight[replica] = 0

    def set_available(self, replica: int, available: bool) -> None:
        """Take a replica out of (or back into) service; its groups move to their next choices."""
        replica = check_int("replica", replica, 0, self.num_replicas - 1)
        if not isinstance(available, (bool, np.bool_)):
            raise TypeError(f"available must be a bool, got {type(available).__name__} {available!r}")
        self._down[replica] = not available

    def grow(self, count: int) -> None:
        """Add ``count`` replicas with the next indices; about count/N of the groups move to them."""
        count = check_int("count", count, 1, (1 << 16) - self.num_replicas)
        self.num_replicas += count
        self._inflight = np.concatenate([self._inflight, np.zeros(count, np.int64)])
        self._down = np.concatenate([self._down, np.zeros(count, bool)])
        self._sticky.clear()  # sticky places predate the newcomers' share

    def clear_sticky(self) -> int:
        """Forget where groups went (they return to their ranked choices); returns how many."""
        count = len(self._sticky)
        self._sticky.clear()
        return count

    def inflight(self) -> np.ndarray:
        """Requests in flight per replica (a copy), int64[N]."""
        return self._inflight.copy()

    @staticmethod
    def _first_with_room(prefs: np.ndarray, load: np.ndarray, limit: int) -> int:
        for r in prefs:
            if load[r] <= limit:
                return int(r)
        return int(np.argmin(load))  # every candidate is full: balance wins over stickiness


def _as_keys(groups: Sequence[object] | np.ndarray) -> np.ndarray:
    """Group keys, int64[G]: a 1-D integer array is taken as keys (range-checked, vectorised)."""
    if isinstance(groups, np.ndarray) and groups.dtype.kind in "iu" and groups.ndim == 1:
        return int_array("group ids", groups, 0, GROUP_ID_MAX).astype(np.int64, copy=False)
    return group_keys(groups)

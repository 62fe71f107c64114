"""The index coordinator: a small Ray actor that keeps the last ``retain_steps`` steps of
published buckets, per destination replica, in its own memory.

A publisher sends one flat array per shard and step; the coordinator copies each destination's
slice, so a publication outlives the replica that made it (a killed replica's last steps can
still be read by its restarted self). A pull returns everything selected for one replica as one
array, so the object store sees one object per pull, never one per bucket: Ray's per-object cost
(about a millisecond a ``ray.put`` on a loaded host) is what made the coordinator slow at scale.
"""
from __future__ import annotations

import time
import uuid
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from rollout_spec.config import check_float, check_int
from rollout_spec.distributed.packing import MAX_REPLICA, Bucket, bucket_tokens
from rollout_spec.token_ids import int_array

MAX_STEP = 2**63 - 1
"""Largest RL step a publication may carry: steps travel as int64 (a pull's ``own_steps``)."""


@dataclass(frozen=True)
class Entry:
    """One retained bucket: what ``src`` generated in ``step`` for the replica that pulls it."""

    seq: int  # position in the coordinator's publish order; cursors compare against it
    src: int  # the replica that generated these sequences
    step: int  # the publisher's RL step
    tokens: int  # tokens in the bucket
    length: int  # int32 elements of the bucket (its slice of a pull's payload)

    @property
    def nbytes(self) -> int:
        """Payload bytes of the bucket."""
        return 4 * self.length


@dataclass(frozen=True)
class Pulled:
    """A pull's answer: the selected entries, oldest first, and their buckets end to end."""

    head: int  # newest seq at the coordinator: the puller's next cursor
    latest_step: int  # newest step any replica published (-1: none yet)
    entries: list[Entry]
    payload: np.ndarray  # int32, the entries' buckets concatenated in order
    over_budget: int  # entries left out by the token budget
    instance: str  # the answering coordinator's id; a restarted or replaced one has a new id

    def buckets(self) -> list[Bucket]:
        """The entries' buckets, as views into the payload."""
        bounds = np.cumsum([0] + [e.length for e in self.entries])
        return [self.payload[a:b] for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist())]


class IndexCoordinator:
    """Keeps, per destination replica, the buckets published in the last ``retain_steps`` steps.

    Run it as a Ray actor through :func:`create_coordinators`; the plain class is tested directly.
    """

    def __init__(self, retain_steps: int = 4) -> None:
        self.retain_steps = check_int("retain_steps", retain_steps, 1, 1 << 20)
        # a restart (Ray reruns __init__) or a replacement starts empty with seq 0 again: pullers
        # compare ids to know that their cursor no longer applies
        self.instance = uuid.uuid4().hex
        self._by_dest: dict[int, deque[tuple[Entry, Bucket]]] = {}
        self._seq = 0
        self._latest_step = -1
        self._kept_from = -(1 << 62)  # every retained entry has step >= this
        self._counters = dict.fromkeys(
            ("publish_s", "pull_s", "publishes", "pulls", "pulled_bytes", "stale_publishes"), 0.0)

    def publish(self, src: int, step: int, dests: list[int], lengths: list[int], payload: np.ndarray) -> int:
        """Keep a copy of bucket i (the i-th ``lengths[i]`` elements of ``payload``) for
        replica ``dests[i]``; return the new head seq. Buckets of a step already older than the
        last ``retain_steps`` steps (a publisher that fell behind, or steps numbered from 0 again)
        are not kept, as eviction would drop them; they are counted in ``stale_publishes``.

        Raises:
            TypeError, ValueError: naming the bad argument (``step`` in [0, MAX_STEP], ``dests`` in
                [0, 65535], ``lengths`` in [1, len(payload)], a corrupt bucket), before anything
                is kept.
        """
        t0 = time.perf_counter()
        src = check_int("src", src, 0, MAX_REPLICA)
        step = check_int("step", step, 0, MAX_STEP)
        flat = payload
        if not isinstance(flat, np.ndarray) or flat.dtype != np.int32 or flat.ndim != 1:
            raise TypeError(f"payload must be a 1-D int32 array, got {type(payload).__name__} "
                            f"{getattr(payload, 'dtype', '')}")
        dest_arr = int_array("dests", dests, 0, MAX_REPLICA)
        sizes = int_array("lengths", lengths, 1, len(flat))
        if len(dest_arr) != len(sizes):
            raise ValueError(f"dests ({len(dest_arr)}) and lengths ({len(sizes)}) differ in length")
        bounds = np.cumsum(sizes, dtype=np.int64).tolist()
        if (bounds[-1] if bounds else 0) != len(flat):
            raise ValueError(f"payload must be a 1-D int32 array of sum(lengths) elements ({len(flat)} given)")
        buckets = [flat[a:b] for a, b in zip([0, *bounds[:-1]], bounds)]
        tokens = [bucket_tokens(b) for b in buckets]  # raises on a corrupt bucket: nothing kept yet
        self._seq += 1
        self._latest_step = max(self._latest_step, step)
        # _evict scans only when the window moves: an entry older than it would stay until then
        stale = step <= self._latest_step - self.retain_steps
        for dest, bucket, count in zip(dest_arr.tolist(), [] if stale else buckets, tokens):
            entry = Entry(self._seq, src, step, count, len(bucket))
            # own the bytes: the sender's buffer may go away
            self._by_dest.setdefault(dest, deque()).append((entry, bucket.copy()))
        self._evict()
        self._count(publish_s=time.perf_counter() - t0, publishes=1, stale_publishes=int(stale))
        return self._seq

    def pull(
        self, dest: int, cursor: int, budget_tokens: Optional[int] = None, own_steps: Optional[Collection[int]] = None
    ) -> Pulled:
        """Buckets for ``dest`` published after ``cursor`` (-1: all retained), oldest first.

        ``dest``'s own publications are left out unless ``own_steps`` is given (a restarted
        replica catching up): then those of steps not in it come back. Under ``budget_tokens``
        (None: no limit, else an int >= 0) the newest entries are kept; the others are counted in
        ``over_budget``.
        """
        t0 = time.perf_counter()
        dest = check_int("dest", dest, 0, MAX_REPLICA)
        cursor = check_int("cursor", cursor, -1)
        budget = float("inf") if budget_tokens is None else check_int("budget_tokens", budget_tokens, 0)
        if own_steps is not None and (isinstance(own_steps, (str, bytes)) or not isinstance(own_steps, Collection)):
            raise TypeError(f"own_steps must be None or a collection of steps, got {type(own_steps).__name__}")
        skip = None if own_steps is None else set(int_array("own_steps", list(own_steps), 0, MAX_STEP).tolist())
        got = [(e, b) for e, b in self._by_dest.get(dest, ()) if e.seq > cursor
               and (e.src != dest or (skip is not None and e.step not in skip))]
        chosen = []
        for e, b in reversed(got):  # newest first under the budget
            if e.tokens <= budget:
                budget -= e.tokens
                chosen.append((e, b))
        chosen.reverse()
        payload = np.concatenate([b for _, b in chosen]) if chosen else np.zeros(0, np.int32)
        self._count(pull_s=time.perf_counter() - t0, pulls=1, pulled_bytes=payload.nbytes)
        return Pulled(self._seq, self._latest_step, [e for e, _ in chosen], payload, len(got) - len(chosen),
                      self.instance)

    def get_retain_steps(self) -> int:
        """Its ``retain_steps``, for a client sizing its backlog by it: a method, since a Ray actor's
        attributes cannot be read through its handle."""
        return self.retain_steps

    def stats(self) -> dict[str, float]:
        """Retained buckets, tokens and bytes, the newest step seen, time spent in publish and pull,
        publishes of a step too old to keep."""
        entries = [e for q in self._by_dest.values() for e, _ in q]
        return {
            "entries": len(entries),
            "tokens": sum(e.tokens for e in entries),
            "bytes": sum(e.nbytes for e in entries),
            "latest_step": self._latest_step,
            "head_seq": self._seq,
            "busy_s": self._counters["publish_s"] + self._counters["pull_s"],
            **self._counters,
        }

    def _count(self, **kw: float) -> None:
        for k, v in kw.items():
            self._counters[k] += v

    def _evict(self) -> None:
        oldest_kept = self._latest_step - self.retain_steps + 1
        if oldest_kept <= self._kept_from:  # once per new step, not per publish: a scan is O(retained)
            return
        self._kept_from = oldest_kept
        for queue in self._by_dest.values():
            # entries arrive in seq order but steps of slow publishers may interleave: filter all
            if any(e.step < oldest_kept for e, _ in queue):
                kept = [(e, b) for e, b in queue if e.step >= oldest_kept]
                queue.clear()
                queue.extend(kept)


_KEEP_ALIVE: dict[tuple[str | None, str], list[Any]] = {}  # driver-side handles, by (namespace, name)


def default_num_shards(num_replicas: int) -> int:
    """Coordinator shards the hooks create for ``num_replicas`` replicas: one per 16 of them."""
    return max(1, check_int("num_replicas", num_replicas, 1, 1 << 16) // 16)


def create_coordinators(
    name: str, num_shards: int = 1, retain_steps: int = 4, namespace: str | None = None, detached: bool = False
) -> list[Any]:
    """Create the named coordinator actors (one per shard), or get them if they exist; call it in
    the driver.

    The driver (the trainer) creates them because a non-detached actor dies with its creator: a
    replica that created them would take the job's index down when it crashes. Shard ``s`` serves
    destination replicas ``r`` with ``r % num_shards == s``, spreading publish traffic at scale.
    ``detached`` keeps them past the driver's exit; then call :func:`destroy_coordinators`.
    Calling it again with the same name returns the running actors (framework hooks may run once
    per replica object in the driver), and replaces any that died.

    Raises:
        TypeError, ValueError: naming a bad argument (``name`` a non-empty str, ``namespace`` one
            or None, ``num_shards`` in [1, 4096], ``retain_steps`` in [1, 1048576], ``detached``
            a bool). ValueError too, before anything is created, when running coordinators of
            that name keep another ``retain_steps``, or this process made them with another
            ``num_shards``: :func:`destroy_coordinators` them first.
    """
    import ray

    _check_names(name, namespace)
    check_int("num_shards", num_shards, 1, 4096)
    check_int("retain_steps", retain_steps, 1, 1 << 20)
    if not isinstance(detached, bool):
        raise TypeError(f"detached must be a bool, got {type(detached).__name__} {detached!r}")
    kept = _KEEP_ALIVE.get((namespace, name))
    if kept is not None and len(kept) != num_shards:
        # rebuilt, the dropped handles would kill the running shards mid-call (ActorDiedError)
        raise ValueError(f"coordinators {name!r} run with num_shards={len(kept)}, not {num_shards}: "
                         "destroy_coordinators() them first")
    live = kept if kept is not None else _found_by_name(name, num_shards, namespace)
    kept_steps = _retain_steps_of(live)
    other = sorted({s for s in kept_steps if s is not None} - {retain_steps})
    if other:
        raise ValueError(f"coordinators {name!r} run with retain_steps={other[0]}, not {retain_steps}: pass "
                         "that, or destroy_coordinators() them first")
    if kept is not None and None not in kept_steps:
        return kept
    remote_cls = ray.remote(num_cpus=0, max_concurrency=1)(IndexCoordinator)
    options: dict[str, Any] = {"namespace": namespace}
    if detached:
        options["lifetime"] = "detached"
    handles = [_live_or_new(remote_cls, _shard_name(name, s), options, retain_steps) for s in range(num_shards)]
    ray.get([h.stats.remote() for h in handles])  # constructed and registered before replicas look
    _KEEP_ALIVE[(namespace, name)] = handles  # a named actor still dies when its handles are dropped
    return handles


def _check_names(name: object, namespace: object) -> None:
    """Refuse a coordinator name that is not a non-empty str, and a namespace that is not one or
    None (Ray would name the actors ``None-0``, or wait on the empty namespace for good)."""
    for field, value, allowed in (("name", name, "a non-empty str"),
                                  ("namespace", namespace, "a non-empty str or None (the caller's)")):
        if value is None and field == "namespace":
            continue
        if not isinstance(value, str):
            raise TypeError(f"{field} must be {allowed}, got {type(value).__name__} {value!r}")
        if not value:
            raise ValueError(f"{field} must be {allowed}, got ''")


def _found_by_name(name: str, num_shards: int, namespace: str | None) -> list[Any]:
    """The actors now registered under the shards' names (dead ones included), without waiting."""
    import ray

    found = []
    for s in range(num_shards):
        try:
            found.append(ray.get_actor(_shard_name(name, s), namespace=namespace))
        except ValueError:  # none: it will be created
            continue
    return found


def _retain_steps_of(handles: list[Any]) -> list[Optional[int]]:
    """Each coordinator's ``retain_steps``, None for one that died (it will be replaced)."""
    import ray

    refs = [h.get_retain_steps.remote() for h in handles]
    out: list[Optional[int]] = []
    for ref in refs:
        try:
            out.append(ray.get(ref))
        except ray.exceptions.RayActorError:
            out.append(None)
    return out


def _live_or_new(remote_cls: Any, shard: str, options: dict[str, Any], retain_steps: int,
                 timeout_s: float = 60.0) -> Any:
    """The running actor named ``shard``, or a new one. An actor that died keeps its name for a
    moment (Ray releases it asynchronously): the lookup is retried until the name is free."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        # not Ray's get_if_exists: in Ray 2.60 a second call with it made the name unresolvable
        # for other processes (tests/test_distributed_wiring.py caught it)
        try:
            handle = ray.get_actor(shard, namespace=options["namespace"])
        except ValueError:  # none (any more): create it
            try:
                return remote_cls.options(name=shard, **options).remote(retain_steps)
            except ValueError:  # the dead one's name is not released yet
                handle = None
        if handle is not None and _all_alive([handle]):
            return handle
        if time.monotonic() > deadline:
            raise RuntimeError(f"coordinator {shard!r} died and its name was not released within {timeout_s} s")
        time.sleep(0.1)


def _all_alive(handles: list[Any]) -> bool:
    """Whether every coordinator still answers (one killed or crashed since is replaced)."""
    import ray

    try:
        ray.get([h.stats.remote() for h in handles])
    except ray.exceptions.RayActorError:
        return False
    return True


def coordinator_handles(name: str, num_shards: int, namespace: str | None = None, timeout_s: float = 60.0) -> list[Any]:
    """Look up the coordinators :func:`create_coordinators` made, waiting up to ``timeout_s``.

    Raises:
        TypeError, ValueError: naming a bad argument (``name`` and ``namespace`` as for
            :func:`create_coordinators`, ``num_shards`` in [1, 4096], ``timeout_s`` in [0, 86400]).
        LookupError: naming the missing actor, when the driver has not created it in time.
    """
    import ray

    _check_names(name, namespace)
    check_int("num_shards", num_shards, 1, 4096)
    timeout_s = check_float("timeout_s", timeout_s, 0.0, 86400.0)
    handles = []
    deadline = time.monotonic() + timeout_s
    for s in range(num_shards):
        while True:
            try:
                handles.append(ray.get_actor(_shard_name(name, s), namespace=namespace))
                break
            except ValueError:
                if time.monotonic() > deadline:
                    raise LookupError(
                        f"no index coordinator {_shard_name(name, s)!r}: call "
                        "rollout_spec.distributed.create_coordinators() in the driver first"
                    ) from None
                time.sleep(0.1)
    return handles


def coordinators_retain_steps(handles: list[Any], timeout_s: float = 60.0) -> int:
    """The ``retain_steps`` the coordinators behind ``handles`` were created with: one cheap call
    per shard, waiting up to ``timeout_s`` for the answers.

    Raises:
        TypeError, ValueError: ``handles`` is not a non-empty list, or ``timeout_s`` not a
            number in [0, 86400].
        ValueError: the shards disagree (they were created by calls with different values).
        ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError: a shard did not answer.
    """
    import ray

    if not isinstance(handles, list):
        raise TypeError(f"handles must be a list of coordinator handles, got {type(handles).__name__}")
    if not handles:
        raise ValueError("handles must hold at least one coordinator handle, got []")
    timeout_s = check_float("timeout_s", timeout_s, 0.0, 86400.0)
    values = ray.get([h.get_retain_steps.remote() for h in handles], timeout=timeout_s)
    if len(set(values)) > 1:
        raise ValueError(f"the coordinator shards disagree on retain_steps: {values} (shard 0 first); "
                         "create them with one create_coordinators call")
    return int(values[0])


def destroy_coordinators(name: str, num_shards: int, namespace: str | None = None) -> None:
    """Kill the coordinators (and so free every retained publication); a shard already gone (it
    died, or was destroyed before) is skipped, so the others are still killed. ``name`` and
    ``namespace`` are checked as :func:`create_coordinators` checks them."""
    import ray

    _check_names(name, namespace)
    check_int("num_shards", num_shards, 1, 4096)
    for s in range(num_shards):
        try:
            handle = ray.get_actor(_shard_name(name, s), namespace=namespace)
        except ValueError:  # no such actor (any more): nothing to free
            continue
        ray.kill(handle)
    _KEEP_ALIVE.pop((namespace, name), None)


def _shard_name(name: str, shard: int) -> str:
    return f"{name}-{shard}"

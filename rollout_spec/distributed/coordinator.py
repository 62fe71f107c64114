"""The index coordinator: a small Ray actor that keeps the last ``retain_steps`` steps of
published buckets, per destination replica, as object refs it owns.

It owns the objects (it ``ray.put``s what publishers send), so a publication outlives the replica
that made it: a killed replica's last steps can still be read by its restarted self. Only refs and
a few ints live in the actor's heap; the token arrays live in the object store.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from rollout_spec.config import check_int
from rollout_spec.distributed.packing import Bucket, bucket_nbytes, bucket_tokens


@dataclass(frozen=True)
class Entry:
    """One retained bucket: what ``src`` generated in ``step`` for the replica that pulls it."""

    seq: int  # position in the coordinator's publish order; cursors compare against it
    src: int  # the replica that generated these sequences
    step: int  # the publisher's RL step
    ref: list[Any]  # [ObjectRef] of the Bucket, wrapped so Ray hands the ref, not the value
    tokens: int  # tokens in the bucket
    nbytes: int  # payload bytes in the bucket


class IndexCoordinator:
    """Keeps, per destination replica, the buckets published in the last ``retain_steps`` steps.

    Run it as a Ray actor through :func:`coordinator_handles`; the plain class is tested directly.
    """

    def __init__(self, retain_steps: int = 4) -> None:
        self.retain_steps = check_int("retain_steps", retain_steps, 1, 1 << 20)
        self._by_dest: dict[int, deque[Entry]] = {}
        self._seq = 0
        self._latest_step = -1
        self._busy_s = 0.0  # time spent inside publish: the coordinator's share of a step
        self._puts = 0

    def publish(self, src: int, step: int, dests: list[int], *buckets: Bucket) -> int:
        """Take ownership of ``buckets`` (one per replica in ``dests``); return the new head seq."""
        check_int("src", src, 0)
        check_int("step", step, 0)
        if len(dests) != len(buckets):
            raise ValueError(f"dests ({len(dests)}) and buckets ({len(buckets)}) differ in length")
        import ray  # the actor runs inside Ray; the class itself imports without it

        t0 = time.perf_counter()
        self._seq += 1
        for dest, bucket in zip(dests, buckets):
            entry = Entry(self._seq, src, step, [ray.put(bucket)], bucket_tokens(bucket), bucket_nbytes(bucket))
            self._by_dest.setdefault(int(dest), deque()).append(entry)
        self._latest_step = max(self._latest_step, step)
        self._evict()
        self._busy_s += time.perf_counter() - t0
        self._puts += len(buckets)
        return self._seq

    def pull(self, dest: int, cursor: int) -> tuple[int, list[Entry]]:
        """Buckets for ``dest`` published after ``cursor`` (-1: all retained), oldest first."""
        entries = [e for e in self._by_dest.get(int(dest), ()) if e.seq > cursor]
        return self._seq, entries

    def stats(self) -> dict[str, float]:
        """Retained buckets, tokens and bytes, the newest step seen, time spent publishing."""
        entries = [e for q in self._by_dest.values() for e in q]
        return {
            "entries": len(entries),
            "tokens": sum(e.tokens for e in entries),
            "bytes": sum(e.nbytes for e in entries),
            "latest_step": self._latest_step,
            "head_seq": self._seq,
            "busy_s": self._busy_s,
            "puts": self._puts,
        }

    def _evict(self) -> None:
        oldest_kept = self._latest_step - self.retain_steps + 1
        for queue in self._by_dest.values():
            # entries arrive in seq order but steps of slow publishers may interleave: filter all
            if any(e.step < oldest_kept for e in queue):
                kept = [e for e in queue if e.step >= oldest_kept]
                queue.clear()
                queue.extend(kept)


_KEEP_ALIVE: dict[tuple[str | None, str], list[Any]] = {}  # driver-side handles, by (namespace, name)


def create_coordinators(
    name: str, num_shards: int = 1, retain_steps: int = 4, namespace: str | None = None, detached: bool = False
) -> list[Any]:
    """Create the named coordinator actors (one per shard); call it once, in the driver.

    The driver (the trainer) creates them because a non-detached actor dies with its creator: a
    replica that created them would take the job's index down when it crashes. Shard ``s`` serves
    destination replicas ``r`` with ``r % num_shards == s``, spreading publish traffic at scale.
    ``detached`` keeps them past the driver's exit; then call :func:`destroy_coordinators`.
    """
    import ray

    check_int("num_shards", num_shards, 1, 4096)
    check_int("retain_steps", retain_steps, 1, 1 << 20)
    remote_cls = ray.remote(num_cpus=0, max_concurrency=1)(IndexCoordinator)
    options: dict[str, Any] = {"namespace": namespace}
    if detached:
        options["lifetime"] = "detached"
    handles = [remote_cls.options(name=_shard_name(name, s), **options).remote(retain_steps) for s in range(num_shards)]
    ray.get([h.stats.remote() for h in handles])  # constructed and registered before replicas look
    _KEEP_ALIVE[(namespace, name)] = handles  # a named actor still dies when its handles are dropped
    return handles


def coordinator_handles(name: str, num_shards: int, namespace: str | None = None, timeout_s: float = 60.0) -> list[Any]:
    """Look up the coordinators :func:`create_coordinators` made, waiting up to ``timeout_s``.

    Raises:
        LookupError: naming the missing actor, when the driver has not created it in time.
    """
    import ray

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


def destroy_coordinators(name: str, num_shards: int, namespace: str | None = None) -> None:
    """Kill the coordinators (and so free every retained publication)."""
    import ray

    for handle in coordinator_handles(name, num_shards, namespace, timeout_s=0.0):
        ray.kill(handle)
    _KEEP_ALIVE.pop((namespace, name), None)


def _shard_name(name: str, shard: int) -> str:
    return f"{name}-{shard}"

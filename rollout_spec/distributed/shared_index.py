"""One drafter index shared across rollout replicas through Ray (coordinator actors).

At each step boundary a replica publishes its finished responses, split by destination: a
response of group g goes to the ``affinity_k`` replicas the router ranks first for g (those that
will serve g next, or take it over when the first is full). A background thread pulls the
buckets meant for this replica from its coordinator shard (one object per pull) and ingests
them with ``drafter.add_sequences``, so generation never waits on the network. A replica that
starts late or restarts pulls everything still retained for it, its own earlier publications
included.

A pull that fails with an error Ray may clear by itself (a timeout, a coordinator that died and is
restarted or replaced, a lost object) is retried with a doubling pause, counted and logged; after
``max_pull_errors`` of them in a row, or at once for any other error, the thread stops and its
error is raised at the owner's next step boundary (``stats`` still answers, with
``puller_failed``). :meth:`SharedIndexClient.restart` starts it again on purpose. A publish the
coordinator did not acknowledge is reported lost, never retried. A publish that raises (the
puller's error, or a submit that failed) keeps the responses that some coordinator shard did not
take, for the coordinators' last ``retain_steps`` steps (read again by ``restart``), and the next
publish sends them under their own steps to those shards only.
"""
from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import numpy as np

from rollout_spec.config import check_float, check_int
from rollout_spec.distributed.coordinator import (
    MAX_STEP,
    Entry,
    Pulled,
    coordinator_handles,
    coordinators_retain_steps,
)
from rollout_spec.distributed.packing import Bucket, split_by_destination, unpack
from rollout_spec.token_ids import token_array
from rollout_spec.distributed.router import GroupRouter
from rollout_spec.groups import GROUP_ID_MAX

logger = logging.getLogger(__name__)


class IngestingDrafter(Protocol):
    """The part of the drafter contract the shared index needs (``NgramDrafter`` has it)."""

    def add_sequences(self, group_ids: list[Optional[int]], sequences: list[list[int]]) -> None:
        """Add finished responses produced elsewhere to the group and global scopes."""


@dataclass(frozen=True)
class SharedIndexConfig:
    """Where a replica sits in the job and how it shares its index; checked at construction."""

    replica_id: int
    """This replica's index, in [0, num_replicas); a restarted replica reuses its old one."""
    num_replicas: int
    """Replicas in the job (the router's N), in [1, 65536]."""
    affinity_k: int = 2
    """Replicas that receive each group's responses: the router's first k choices for the group."""
    ingest_budget_tokens: int = 4_000_000
    """Most tokens ingested from one pull, newest first; keep it at or below capacity_tokens."""
    poll_interval_s: float = 0.05
    """Pause of the background thread between pulls while publications arrive."""
    max_poll_interval_s: float = 1.0
    """The pause doubles after each empty pull up to this, so idle replicas do not keep their
    coordinator shard busy (N/S replicas each pull once per pause)."""
    name: str = "rollout-spec-index"
    """Name prefix of the coordinator actors (one job, one name)."""
    namespace: Optional[str] = None
    """Ray namespace of the coordinator actors (None: the caller's)."""
    num_shards: int = 1
    """Coordinator actors, in [1, min(4096, num_replicas)] (a shard beyond the replicas would
    serve none); destination r is served by shard r % num_shards (see
    ``coordinator.default_num_shards``)."""
    router_seed: int = 0
    """Seed of the router's ranking; must match the request router's."""
    apply_in_thread: bool = True
    """Ingest from the background thread (NgramDrafter serialises calls with a mutex and
    releases the GIL); False stages fetched responses until the owner calls ``apply()``."""
    apply_chunk_sequences: int = 16
    """Sequences per ``add_sequences`` call, so a concurrent ``propose`` waits for at most one
    small chunk (the drafter indexes a few microseconds per token)."""
    lookup_timeout_s: float = 60.0
    """How long a starting replica waits for the driver to create the coordinators."""
    pull_timeout_s: float = 60.0
    """How long one pull waits for its coordinator, in (0, 86400]; a pull that takes longer fails
    with Ray's ``GetTimeoutError`` and counts toward ``max_pull_errors``, so a coordinator that
    hangs without failing does not hold the puller for good."""
    max_pull_errors: int = 10
    """Failed pulls in a row, of errors that may pass (see ``transient_ray_error``), after which
    the puller stops; in [1, 1000000] (1: stop at the first, as any other error does). The pause
    after a failed pull doubles from ``poll_interval_s`` up to ``max_poll_interval_s``: with the
    defaults ten failures span about 7 s."""
    retain_steps: Optional[int] = None
    """The coordinators' ``retain_steps``: None (the default) reads it from them when the client
    is built and at each ``restart()``, as one cheap call per shard; an int in [1, 1048576] must
    equal theirs (the client, and its ``restart()``, refuse another). A publish that raises keeps
    the responses of at most this many steps, the newest, for the next publish; older ones would
    be stale there. It is read at those two points, not when a publish raises: the puller may
    have stopped on a dead coordinator by then."""

    def __post_init__(self) -> None:
        def put(field: str, value: object) -> None:  # frozen: store the checked (plain int/float) value
            object.__setattr__(self, field, value)

        put("num_replicas", check_int("num_replicas", self.num_replicas, 1, 1 << 16))
        put("replica_id", check_int("replica_id", self.replica_id, 0, self.num_replicas - 1))
        put("affinity_k", check_int("affinity_k", self.affinity_k, 1, 1 << 16))  # above num_replicas: all
        put("ingest_budget_tokens", check_int("ingest_budget_tokens", self.ingest_budget_tokens, 1, 1 << 40))
        put("poll_interval_s", check_float("poll_interval_s", self.poll_interval_s, 0.0, 3600.0))
        put("max_poll_interval_s",
            check_float("max_poll_interval_s", self.max_poll_interval_s, self.poll_interval_s, 3600.0))
        put("num_shards", check_int("num_shards", self.num_shards, 1, min(4096, self.num_replicas)))
        put("router_seed", check_int("router_seed", self.router_seed, 0, 2**63 - 1))
        put("lookup_timeout_s", check_float("lookup_timeout_s", self.lookup_timeout_s, 0.0, 86400.0))
        put("pull_timeout_s", check_float("pull_timeout_s", self.pull_timeout_s, 0.0, 86400.0, lo_open=True))
        put("apply_chunk_sequences", check_int("apply_chunk_sequences", self.apply_chunk_sequences, 1, 1 << 20))
        put("max_pull_errors", check_int("max_pull_errors", self.max_pull_errors, 1, 1_000_000))
        if self.retain_steps is not None:
            put("retain_steps", check_int("retain_steps", self.retain_steps, 1, 1 << 20))
        if not isinstance(self.apply_in_thread, bool):
            raise TypeError(f"apply_in_thread must be a bool, got {self.apply_in_thread!r}")
        if not isinstance(self.name, str):
            raise TypeError(f"name must be a str, got {self.name!r}")
        if self.namespace is not None and not isinstance(self.namespace, str):
            raise TypeError(f"namespace must be a str or None, got {self.namespace!r}")
        if not self.name or self.namespace == "":
            raise ValueError("name and namespace must be non-empty strs (namespace None: the caller's)")


@dataclass
class _Batch:
    """Responses recorded for one step between two publishes, and the coordinator shards that
    already took them: after a submit that raised, only the other shards are sent them again."""

    groups: list[int]
    """Each response's group id."""
    seqs: list[np.ndarray]
    """The responses' token ids, one array each."""
    taken_by: set[int] = field(default_factory=set)
    """Shards whose publish call for these responses was submitted."""


@dataclass
class _PublishCost:
    """What one ``publish`` submitted: counted per call, so a publish that raised counts the calls
    submitted before the failure and no more."""

    bytes: int = 0
    """Bytes of the buckets submitted."""
    tokens: int = 0
    """Tokens of the responses submitted to a shard for the first time."""
    buckets: int = 0
    """Buckets submitted (one per destination replica and call)."""
    steps: int = 0
    """Steps that left the backlog: every shard with buckets for them took all of them."""


class SharedIndexClient:
    """A replica's end of the shared index: ``record`` + ``publish`` out, a puller thread in.

    Args:
        drafter: the replica's drafter (anything with ``add_sequences``).
        config: the replica's :class:`SharedIndexConfig`.
        start: start the background puller now (tests may drive :meth:`poll` by hand).

    Raises:
        TypeError: when the drafter has no ``add_sequences``, ``config`` is not a
            :class:`SharedIndexConfig` or ``start`` not a bool.
        LookupError: the coordinators are not found within ``lookup_timeout_s``.
        ValueError: ``config.retain_steps`` is not the coordinators' value, or their shards disagree.
        ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError: a coordinator did not tell
            its ``retain_steps`` within ``lookup_timeout_s``.
    """

    def __init__(self, drafter: IngestingDrafter, config: SharedIndexConfig, start: bool = True) -> None:
        if not callable(getattr(drafter, "add_sequences", None)):
            raise TypeError(f"drafter {type(drafter).__name__} has no add_sequences(group_ids, sequences)")
        if not isinstance(config, SharedIndexConfig):
            raise TypeError(f"config must be a SharedIndexConfig, got {type(config).__name__}")
        if not isinstance(start, bool):
            raise TypeError(f"start must be a bool, got {type(start).__name__} {start!r}")
        self.drafter = drafter
        self.config = config
        self.router = GroupRouter(config.num_replicas, seed=config.router_seed)
        self._coords = self._look_up_coordinators(config.lookup_timeout_s)
        self._retain_steps = self._agreed_retain_steps(self._coords)
        self._recorded: tuple[list[int], list[np.ndarray]] = ([], [])
        # step -> its responses, until every shard took them (a publish that raised keeps what some did
        # not take); the owner's only
        self._backlog: dict[int, list[_Batch]] = {}
        self._staged: deque[tuple[list[Optional[int]], list[list[int]]]] = deque()
        self._shard = config.replica_id % config.num_shards  # the only shard holding our buckets
        self._cursor = -1  # -1: the first pull also takes our own history
        self._instance: Optional[str] = None  # the coordinator shard's id at the last pull
        self._latest_step = -1
        self._step_at_join = -1
        self._published_steps: set[int] = set()  # ours from this process: never re-ingested
        self._inflight_publishes: list[tuple[int, int, Any]] = []  # (step, shard, ref)
        self._poll_lock = threading.Lock()
        self._pub_lock = threading.Lock()  # the owner appends publishes, the puller reaps them
        self._stage_lock = threading.Lock()
        self._stop = threading.Event()
        self._error: Optional[BaseException] = None
        self._stats = dict.fromkeys(_COUNTERS, 0.0)
        self._thread: Optional[threading.Thread] = None
        weakref.finalize(self, self._stop.set)  # dropped without close(): the puller stops too
        if start:
            self.start()

    @property
    def retain_steps(self) -> int:
        """The coordinators' ``retain_steps``, read at construction and at each :meth:`restart`: the
        backlog keeps at most this many steps."""
        return self._retain_steps

    def _agreed_retain_steps(self, coords: list[Any]) -> int:
        """The ``retain_steps`` of the coordinators behind ``coords``, checked against the config's
        when it names one."""
        theirs = coordinators_retain_steps(coords, self.config.lookup_timeout_s)
        ours = self.config.retain_steps
        if ours is not None and ours != theirs:
            raise ValueError(f"SharedIndexConfig.retain_steps={ours} but the coordinators {self.config.name!r} "
                             f"keep {theirs} steps: leave it None to use theirs")
        return theirs

    def record(self, group_id: Optional[int], token_ids: Sequence[int] | np.ndarray) -> None:
        """Note one finished response generated here; groupless ones (None) are not shared.

        ``group_id`` is an int in [0, 2**31); ``token_ids`` a 1-D integer sequence or array of
        token ids in [0, 2**31).
        """
        if group_id is None:
            return
        group_id = check_int("group_id", group_id, 0, GROUP_ID_MAX)
        tokens = token_array("token_ids", token_ids)
        if tokens is token_ids:  # keep our own copy: the caller may reuse its buffer
            tokens = tokens.copy()
        self._recorded[0].append(group_id)
        self._recorded[1].append(tokens)

    def publish(self, step: int) -> dict[str, float]:
        """Send what was recorded since the last publish, as step ``step`` (an int in
        [0, MAX_STEP]); returns at once.

        The responses go into step ``step``'s backlog entry first; the backlog holds the newest
        ``retain_steps`` steps (older ones are dropped, counted in ``backlog_sequences_dropped``
        and logged). While the puller is stopped, its error is raised and the backlog is kept.
        Otherwise the backlog is sent oldest step first, each step under its own number, so no
        response is labelled with a later step than its own. A step is submitted with one call per
        coordinator shard that has buckets for it; the backlog remembers which shards took which of
        its responses, and a step leaves it once every such shard took every response. When a
        submit raises (a Ray call that failed), the error is raised and the step keeps only what
        its other shards did not take, with every later step, for the next publish: no shard is
        sent a response twice.

        Returns the cost paid on the calling thread, over all the calls submitted: ``seconds``,
        ``bytes`` and ``buckets`` (those submitted), ``tokens`` (of the responses submitted to a
        shard for the first time).
        """
        step = check_int("step", step, 0, MAX_STEP)
        self._hold_recorded(step)
        self._raise_background_error()
        t0 = time.perf_counter()
        cost = _PublishCost()
        try:
            self._send_backlog(step, cost)
        finally:  # the calls submitted before a failure were sent: count them
            seconds = time.perf_counter() - t0
            self._add_stats(publish_s=seconds, published_bytes=cost.bytes, published_tokens=cost.tokens,
                            publishes=cost.steps)
        return {"seconds": seconds, "bytes": cost.bytes, "tokens": cost.tokens, "buckets": cost.buckets}

    def _send_backlog(self, step: int, cost: _PublishCost) -> None:
        """Submit the backlog's steps and ``step`` (sent even without responses), oldest first,
        adding to ``cost``; a step leaves the backlog only once every shard took all of it, so one
        whose submit raises stays there (less what its other shards took) with every later one."""
        for s in sorted(self._backlog.keys() | {step}):
            self._send_step(s, self._backlog.get(s, []), cost)
            self._backlog.pop(s, None)
            cost.steps += 1

    def _hold_recorded(self, step: int) -> None:
        """Move the recorded responses into ``step``'s backlog entry, then drop the entries the
        coordinators would not keep next to the newest step (counted and logged): the backlog holds
        at most ``retain_steps`` steps, whatever the owner records between publishes.

        The responses join the entry's last batch while no shard has taken it; after a publish that
        failed part-way they start a batch of their own, which every shard still has to take."""
        groups, seqs = self._recorded
        self._recorded = ([], [])
        if seqs:
            batches = self._backlog.setdefault(step, [])
            if batches and not batches[-1].taken_by:
                batches[-1].groups.extend(groups)
                batches[-1].seqs.extend(seqs)
            else:
                batches.append(_Batch(groups, seqs))
        self._trim_backlog(max([step, *self._backlog]))

    def _trim_backlog(self, newest: int) -> None:
        """Drop the backlog's steps older than the newest ``retain_steps`` up to step ``newest``,
        counted in ``backlog_sequences_dropped`` and logged."""
        oldest_kept = newest - self._retain_steps + 1
        for old in [s for s in self._backlog if s < oldest_kept]:
            dropped = sum(len(batch.seqs) for batch in self._backlog.pop(old))
            self._add_stats(backlog_sequences_dropped=dropped)
            logger.warning("shared-index replica %d dropped the %d responses of step %d: its publish failed "
                           "and it is outside the newest retain_steps=%d steps", self.config.replica_id, dropped, old,
                           self._retain_steps)

    def _send_step(self, step: int, batches: list[_Batch], cost: _PublishCost) -> None:
        """Submit step ``step``'s batches to every coordinator shard that has buckets for them and
        has not taken them yet, one call per shard, adding to ``cost``. Shards owed the same
        batches share one split; a batch that every shard it goes to took leaves ``batches``, even
        when a later submit raises."""
        self._published_steps.add(step)
        prefs = [self.router.preferences(np.asarray(b.groups, np.int64), self.config.affinity_k) for b in batches]
        held = [p % self.config.num_shards for p in prefs]  # the shard of each destination
        shards = [set(np.unique(h).tolist()) for h in held]
        try:
            for members, owed in self._shards_by_batches_owed(batches, shards).items():
                self._submit_to_shards(step, [batches[i] for i in members], [prefs[i] for i in members],
                                       [held[i] for i in members], owed, cost)
        finally:
            batches[:] = [b for b, needed in zip(batches, shards) if not needed <= b.taken_by]

    @staticmethod
    def _shards_by_batches_owed(batches: list[_Batch], shards: list[set[int]]) -> dict[tuple[int, ...], list[int]]:
        """Each set of batches (as their indexes) some shard is owed, with those shards in
        ascending order: a shard is owed a batch that has buckets for it and that it did not take."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for shard in sorted(set().union(*shards)):
            owed = tuple(i for i, b in enumerate(batches) if shard in shards[i] and shard not in b.taken_by)
            if owed:
                groups.setdefault(owed, []).append(shard)
        return groups

    def _submit_to_shards(self, step: int, batches: list[_Batch], prefs: list[np.ndarray], held: list[np.ndarray],
                          shards: list[int], cost: _PublishCost) -> None:
        """Submit ``batches`` (destinations ``prefs``, held by shards ``held``) to each of
        ``shards``, one call each, marking them taken by a shard once its call is submitted; the
        first submit that raises stops.

        A response's tokens count at its first submit to any shard (``counted``), so one that
        several shards or publishes carry is counted once."""
        groups = np.asarray([g for b in batches for g in b.groups], np.int64)
        buckets = split_by_destination(groups, [s for b in batches for s in b.seqs], np.concatenate(prefs))
        lengths = [np.fromiter((len(s) for s in b.seqs), np.int64, len(b.seqs)) for b in batches]
        counted = [np.isin(h, sorted(b.taken_by)).any(axis=1) for h, b in zip(held, batches)]
        by_shard: dict[int, list[int]] = {}
        for dest in buckets:
            by_shard.setdefault(dest % self.config.num_shards, []).append(dest)
        for shard in shards:
            dests = by_shard.get(shard, [])
            self._submit_call(step, shard, dests, buckets)
            cost.bytes += sum(int(buckets[d].nbytes) for d in dests)
            cost.buckets += len(dests)
            for batch, shard_of, length, done in zip(batches, held, lengths, counted):
                here = (shard_of == shard).any(axis=1)
                cost.tokens += int(length[here & ~done].sum())
                done |= here
                batch.taken_by.add(shard)

    def _submit_call(self, step: int, shard: int, dests: list[int], buckets: dict[int, Bucket]) -> None:
        """Submit the buckets of ``dests`` to coordinator shard ``shard`` as one Ray call and keep
        its reference for the puller to check; raises when Ray cannot submit it."""
        # one flat argument per shard: Ray's cost is per object, not per byte, at these sizes
        payload = np.concatenate([buckets[d] for d in dests])
        lengths = [len(buckets[d]) for d in dests]
        ref = self._coords[shard].publish.remote(self.config.replica_id, step, dests, lengths, payload)
        with self._pub_lock:
            self._inflight_publishes.append((step, shard, ref))

    def flush(self, timeout_s: float = 60.0) -> None:
        """Wait until every publish has reached its coordinator (tests, shutdown), then check them
        as the puller does: one lost to an error that may pass is counted in ``publish_errors``
        and logged, never raised. ``timeout_s`` is a number in [0, 86400].

        Raises:
            TimeoutError: publishes still in flight after ``timeout_s``; they stay in flight, and
                the puller (or the next flush) checks them when they finish.
            Exception: the first error of a finished publish that cannot pass (see
                ``transient_ray_error``), after every finished publish was checked (the losses
                are counted, further such errors logged).
        """
        timeout_s = check_float("timeout_s", timeout_s, 0.0, 86400.0)
        in_flight = self._reap_publishes(timeout_s)
        if in_flight:
            raise TimeoutError(f"{in_flight} publishes of replica {self.config.replica_id} are still in "
                               f"flight after timeout_s={timeout_s} s")

    def poll(self) -> int:
        """Pull what the coordinator holds for this replica and stage it; returns sequences staged.

        The background thread calls this in a loop; call it yourself only with ``start=False``
        (:meth:`join` takes the first pull on the owner's thread; pulls are serialised). A
        coordinator shard that answers with a new instance id (Ray restarted it, or the driver
        replaced it) numbers its publications from 0 again: the cursor is dropped and everything
        it holds is pulled, counted in ``coordinator_resets``. A reply whose buckets do not
        unpack raises ``ValueError`` ("corrupt bucket") and moves no cursor, so nothing is skipped.
        """
        with self._poll_lock:
            self._reap_publishes()
            t0 = time.perf_counter()
            got = self._pull(self._cursor)
            if self._instance is not None and got.instance != self._instance:
                logger.warning("shared-index coordinator shard %d of replica %d was restarted or replaced: "
                               "what it held is lost; pulling all the new one holds",
                               self._shard, self.config.replica_id)
                self._add_stats(coordinator_resets=1)
                # the old cursor means nothing to the new one, even if this pull fails
                self._cursor, self._instance = -1, got.instance
                got = self._pull(-1)
            kept = self._not_published_here(got)
            batches = [unpack(bucket) for _, bucket in kept]  # a corrupt reply raises: no cursor moves
            if self._instance is None:
                self._step_at_join = got.latest_step
            self._instance = got.instance
            self._cursor = got.head
            self._latest_step = max(self._latest_step, got.latest_step)
            with self._stage_lock:
                self._staged.extend(batches)
            fetched = sum(len(seqs) for _, seqs in batches)
            self._add_stats(fetch_s=time.perf_counter() - t0, fetched_bytes=sum(e.nbytes for e, _ in kept),
                            fetched_tokens=sum(e.tokens for e, _ in kept), entries_fetched=len(kept),
                            entries_over_budget=got.over_budget, pulls=1)
            return fetched

    @property
    def latest_step(self) -> int:
        """Newest step any replica had published at this replica's last pull (-1: none)."""
        return self._latest_step

    def join(self) -> None:
        """Take the first pull on the calling thread unless one has returned, so ``step_at_join``
        is known (this waits on the coordinator, as the puller's pull does); re-raises an error
        the puller hit."""
        self._raise_background_error()
        if self._cursor < 0:
            self.poll()

    @property
    def step_at_join(self) -> int:
        """Newest step any replica had published at this replica's first pull (-1: none, or no
        pull yet): a replica (re)started mid-job is generating for the step after it."""
        return self._step_at_join

    def apply(self, max_sequences: Optional[int] = None) -> int:
        """Ingest staged responses into the drafter on the calling thread; never waits on Ray.

        Call it between decode steps or at a step boundary (with ``apply_in_thread=False``).
        ``max_sequences`` (None: all staged) is an int >= 0; returns the sequences ingested.
        """
        if max_sequences is not None:
            max_sequences = check_int("max_sequences", max_sequences, 0)
        done, chunk = 0, self.config.apply_chunk_sequences
        while max_sequences is None or done < max_sequences:
            take = chunk if max_sequences is None else min(chunk, max_sequences - done)
            with self._stage_lock:
                if not self._staged:
                    break
                groups, seqs = self._staged.popleft()
                if len(seqs) > take:  # put the rest back in front: order is kept
                    self._staged.appendleft((groups[take:], seqs[take:]))
                    groups, seqs = groups[:take], seqs[:take]
            done += self._ingest(groups, seqs)
        return done

    def start(self) -> None:
        """Start the background puller (idempotent). It holds the client only weakly, so an owner
        that drops the client without :meth:`close` lets it be collected, and the puller stops."""
        if self._thread is None:
            self._thread = threading.Thread(target=_pull_until_stopped, args=(weakref.ref(self), self._stop),
                                            name="rollout-spec-index-puller", daemon=True)
            self._thread.start()

    def restart(self, timeout_s: float = 30.0) -> None:
        """Start a new puller after the old one stopped (on an error, or through :meth:`close`).

        For an owner that recovers on purpose after a step boundary raised the puller's error:
        the error is cleared, the coordinators are looked up again by name (the driver's
        ``create_coordinators`` replaces one that died), and pulling resumes from the cursor, so
        nothing already ingested comes again. Publications the old puller reported lost stay
        lost; the responses of steps whose publish raised go out with the next publish.
        ``timeout_s`` (a number in [0, 3600]) bounds the wait for a stopping puller to exit.

        The coordinators' ``retain_steps`` is read again, as at construction: the driver may have
        re-created them with another value. Under a smaller one, the backlog's steps outside the
        new window (the ``retain_steps`` steps up to its newest) are dropped at once, counted and
        logged as :meth:`publish` does, which would drop them next; under a larger one it keeps
        more steps from then on (those dropped before the restart stay dropped). When it raises,
        nothing has changed: the puller stays stopped (with its error, if any), and ``restart()``
        may be called again.

        Raises:
            RuntimeError: the puller is running, or the stopping one did not exit in time.
            LookupError: the coordinators are not found within ``lookup_timeout_s``.
            ValueError: ``config.retain_steps`` is not the coordinators' value, or their shards
                disagree.
            ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError: a coordinator did not
                tell its ``retain_steps`` within ``lookup_timeout_s``.
        """
        timeout_s = check_float("timeout_s", timeout_s, 0.0, 3600.0)
        old = self._thread
        if old is not None and old.is_alive():
            if self._error is None and not self._stop.is_set():
                raise RuntimeError("the shared-index puller is running: restart() is for one that stopped")
            old.join(timeout=timeout_s)  # it has failed or been told to stop: it is leaving its loop
            if old.is_alive():
                raise RuntimeError(f"the stopped shared-index puller did not exit within {timeout_s} s")
        coords = self._look_up_coordinators(self.config.lookup_timeout_s)
        retain_steps = self._agreed_retain_steps(coords)
        self._coords, self._retain_steps = coords, retain_steps
        if self._backlog:
            self._trim_backlog(max(self._backlog))
        self._error = None
        self._stop.clear()
        self._thread = None
        logger.warning("shared-index puller of replica %d restarted", self.config.replica_id)
        self.start()

    def close(self) -> None:
        """Stop the puller; re-raise an error it hit."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._raise_background_error()

    def stats(self) -> dict[str, float]:
        """Counters: published/fetched bytes and tokens, seconds spent, entries over budget, staged
        (``fetched_*`` and ``entries_fetched`` count what a pull staged for ingest, not our own
        entries of this process's steps that came back);
        failed pulls that were retried (``pull_errors``), publishes reported lost
        (``publish_errors``), coordinators found restarted or replaced (``coordinator_resets``),
        responses of steps whose publish raised dropped as older than ``retain_steps``
        (``backlog_sequences_dropped``), sequences waiting in the backlog
        (``backlog_sequences``, those some shards took included). ``publishes`` counts steps that
        every shard took whole; ``published_bytes`` and ``published_tokens`` count what was submitted,
        a response's tokens once (see :meth:`publish`).

        It never raises the puller's error, so an owner can log the counters after a step
        boundary raised it: ``puller_failed`` is 1.0 while the puller is stopped on an error
        (:attr:`puller_error`; ``publish``, ``join`` and ``close`` raise it) and 0.0 otherwise."""
        with self._stage_lock:
            out = dict(self._stats)
            out["staged_sequences"] = float(sum(len(s) for _, s in self._staged))
        # list() copies the owner's dict in one step, so a stats() from another thread during a
        # publish cannot meet it mid-resize
        out["backlog_sequences"] = float(sum(len(b.seqs) for batches in list(self._backlog.values())
                                             for b in list(batches)))
        out["puller_failed"] = float(self._error is not None)
        return out

    @property
    def puller_error(self) -> Optional[BaseException]:
        """The error that stopped the puller, until :meth:`restart` clears it (None: none)."""
        return self._error

    def _pull_round(self, wait: float, failures: int) -> tuple[float, float, int]:
        """One round of the puller: pull, and ingest with ``apply_in_thread``.

        ``wait`` is the pause after the last pull that did not fail and ``failures`` the failed
        pulls in a row; returns the pause before the next round and both, updated. Raises the
        error that stops the puller.
        """
        import ray

        if not ray.is_initialized():  # calling into a shut-down Ray aborts the process
            raise RuntimeError("Ray was shut down while the shared index was open")
        base = self.config.poll_interval_s
        try:
            got = self.poll()
        except Exception as exc:  # a transient one below the limit is retried
            self._retry_or_raise(exc, failures + 1)
            pause = min(max(base, 1e-3) * 2.0 ** min(failures + 1, 30), self.config.max_poll_interval_s)
            return pause, wait, failures + 1
        if self.config.apply_in_thread:
            self.apply()
        wait = base if got else min(max(2 * wait, base, 1e-3), self.config.max_poll_interval_s)
        return wait, wait, 0

    def _stop_on(self, exc: BaseException) -> None:
        """Keep the error that stopped the puller for the owner's next publish/join/close."""
        self._error = exc
        logger.error("shared-index puller of replica %d stopped (raised at the next step "
                     "boundary): %r", self.config.replica_id, exc)

    def _retry_or_raise(self, exc: Exception, failures: int) -> None:
        """Count and log a pull that failed ``failures`` times in a row and look the coordinators
        up again (one the driver replaced has a new handle); re-raise ``exc`` when it cannot pass
        or the limit is reached."""
        if not transient_ray_error(exc):
            raise exc
        self._add_stats(pull_errors=1)
        if failures >= self.config.max_pull_errors:
            raise exc
        logger.warning("shared-index pull of replica %d failed (%d in a row; the puller stops at %d): %r",
                       self.config.replica_id, failures, self.config.max_pull_errors, exc)
        self._refresh_coordinators()

    def _refresh_coordinators(self) -> None:
        """Look the coordinators up again by name, at once (one the driver replaced has a new
        handle); keep the old handles when none is found under the name yet."""
        try:
            self._coords = self._look_up_coordinators(0.0)
        except LookupError as err:  # none under the name yet: keep the old handles, retry later
            logger.warning("shared-index replica %d: %s", self.config.replica_id, err)

    def _not_published_here(self, got: Pulled) -> list[tuple[Entry, Bucket]]:
        """The pulled entries and buckets, less our own of steps this process published.

        A pull from the start sends the steps published so far, but the owner may publish
        another before the coordinator answers (a pull after a coordinator reset runs while
        the owner publishes): that step's buckets for us come back and would be ingested twice.
        A step is recorded before its publish is sent, so the set read here has it.
        """
        published = set(self._published_steps)
        return [(e, b) for e, b in zip(got.entries, got.buckets())
                if e.src != self.config.replica_id or e.step not in published]

    def _look_up_coordinators(self, timeout_s: float) -> list[Any]:
        """The handles of this job's coordinator shards, found by name (LookupError after
        ``timeout_s`` without them)."""
        cfg = self.config
        return coordinator_handles(cfg.name, cfg.num_shards, cfg.namespace, timeout_s)

    def _pull(self, cursor: int) -> Pulled:
        """One pull from our shard after ``cursor``; at -1 our own steps from this process are
        left out (a restarted replica's earlier ones come back)."""
        import ray

        own = sorted(self._published_steps) if cursor < 0 else None
        return ray.get(self._coords[self._shard].pull.remote(
            self.config.replica_id, cursor, self.config.ingest_budget_tokens, own), timeout=self.config.pull_timeout_s)

    def _ingest(self, groups: list[Optional[int]], seqs: list[list[int]]) -> int:
        t0 = time.perf_counter()
        self.drafter.add_sequences(groups, seqs)
        took = time.perf_counter() - t0
        self._add_stats(apply_s=took, sequences_applied=len(seqs))
        with self._stage_lock:  # the longest the drafter's mutex was held by one ingest call
            self._stats["apply_max_s"] = max(self._stats["apply_max_s"], took)
        return len(seqs)

    def _reap_publishes(self, timeout_s: float = 0.0) -> int:
        """Check the publishes in flight that finish within ``timeout_s``; returns how many are
        left in flight. The wait holds no lock (the owner may publish meanwhile); a publish
        another caller reaped during it is checked once, by that caller."""
        import ray

        with self._pub_lock:
            refs = [ref for _, _, ref in self._inflight_publishes]
        if not refs:
            return 0
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        finished = set(done)
        with self._pub_lock:
            reaped = [p for p in self._inflight_publishes if p[2] in finished]
            self._inflight_publishes = [p for p in self._inflight_publishes if p[2] not in finished]
            in_flight = len(self._inflight_publishes)
        self._check_published(reaped)
        return in_flight

    def _check_published(self, reaped: list[tuple[int, int, Any]]) -> None:
        """Check every finished publish of ``reaped`` (step, shard, ref): count and log each one
        lost to an error that may pass, then raise the first error that cannot pass (the others
        are logged), so no publish of the reap goes unchecked.

        A lost publish is not sent again: Ray cannot tell whether the coordinator kept it before
        failing (a resend could duplicate it in the peers' indexes), and it only costs draft
        quality, never correctness. The coordinators are looked up again, once, before the losses
        are counted: a shard we only publish to is never pulled from, so no failed pull would find
        the driver's replacement of a dead one, and every later publish to it would be lost."""
        lost: list[tuple[int, int, Exception]] = []
        fatal: list[tuple[int, int, Exception]] = []
        for step, shard, ref in reaped:
            exc = _publish_error(ref)
            if exc is not None:
                (lost if transient_ray_error(exc) else fatal).append((step, shard, exc))
        if lost:
            self._refresh_coordinators()
        for step, shard, exc in lost:
            self._count_lost_publish(step, shard, exc)
        if fatal:
            self._raise_first_publish_error(fatal)

    def _count_lost_publish(self, step: int, shard: int, exc: Exception) -> None:
        """Count and log a publish lost to an error that may pass (it is not resent)."""
        self._add_stats(publish_errors=1)
        logger.warning("shared-index publish of step %d by replica %d to coordinator shard %d was lost "
                       "(not resent): %r", step, self.config.replica_id, shard, exc)

    def _raise_first_publish_error(self, fatal: list[tuple[int, int, Exception]]) -> None:
        """Raise the first of one reap's publish errors that cannot pass, ``fatal`` (step, shard,
        error), unwrapped so its type tells the caller what failed; log the others first, since
        only one error can be raised."""
        for step, shard, exc in fatal[1:]:
            logger.error("shared-index publish of step %d by replica %d to coordinator shard %d failed "
                         "too (not raised: the reap raises the first such error): %r",
                         step, self.config.replica_id, shard, exc)
        raise fatal[0][2]

    def _add_stats(self, **kw: float) -> None:
        with self._stage_lock:
            for k, v in kw.items():
                self._stats[k] += v

    def _raise_background_error(self) -> None:
        if self._error is not None:
            raise RuntimeError("shared-index puller thread failed") from self._error


def _pull_until_stopped(client_ref: weakref.ref[SharedIndexClient], stop: threading.Event) -> None:
    """The puller thread: pull rounds until ``stop`` is set or the client is gone.

    The client is held only during a round, never through the pause between rounds: an owner that
    drops it without ``close()`` lets it be collected, and its finalizer sets ``stop``.
    """
    client = client_ref()
    if client is None:  # dropped before its puller began
        return
    wait, failures = client.config.poll_interval_s, 0  # failed pulls in a row
    while client is not None and not stop.is_set():
        try:
            pause, wait, failures = client._pull_round(wait, failures)
        except BaseException as exc:  # surfaced on the owner's next publish/join/close
            client._stop_on(exc)
            return
        del client  # hold no reference while paused
        stop.wait(pause)
        client = client_ref()


def _publish_error(ref: Any) -> Optional[Exception]:
    """The error of a finished publish's call (the coordinator's or Ray's), or None if it succeeded."""
    import ray

    try:
        ray.get(ref)
    except Exception as exc:  # judged by the caller: lost, or raised
        return exc
    return None


def transient_ray_error(exc: BaseException) -> bool:
    """Whether a failed coordinator call may succeed later: Ray's ``GetTimeoutError``, a
    ``RayActorError`` (the actor is restarting, unreachable, or died and may be replaced by the
    driver) or an ``ObjectLostError``. An error raised by the coordinator's own code (Ray re-raises
    it as a ``RayTaskError`` that is also the original type, e.g. ``ValueError``) and every other
    error are not."""
    import ray

    passing = (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError, ray.exceptions.ObjectLostError)
    return isinstance(exc, passing) and not isinstance(exc, ray.exceptions.RayTaskError)


_COUNTERS = (
    "publishes", "publish_s", "published_bytes", "published_tokens", "pulls", "fetch_s", "fetched_bytes",
    "fetched_tokens", "entries_fetched", "entries_over_budget", "apply_s", "apply_max_s",
    "sequences_applied", "pull_errors", "publish_errors", "coordinator_resets", "backlog_sequences_dropped",
)

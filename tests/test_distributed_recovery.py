"""The shared index's puller survives errors that pass and stops on the others.

The coordinator runs in-process behind a handle that can fail on demand; Ray's own exception
classes are raised, and ``ray.get`` / ``ray.wait`` are replaced by their in-process answers.
"""
from __future__ import annotations

import gc
import logging
import time
import weakref
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="the shared index needs Ray: pip install 'rollout-spec[ray]'")

from rollout_spec.distributed import shared_index  # noqa: E402
from rollout_spec.distributed.coordinator import IndexCoordinator, Pulled  # noqa: E402
from rollout_spec.distributed.packing import pack, unpack  # noqa: E402
from rollout_spec.distributed.shared_index import SharedIndexClient, SharedIndexConfig  # noqa: E402
from rollout_spec.distributed.sharing import SharingDrafter  # noqa: E402
from polling import wait_until  # noqa: E402


class _Ref:
    """What ``.remote()`` returned: the call's result, or the error ``ray.get`` raises."""

    def __init__(self, call: Callable[[], Any]) -> None:
        try:
            self.value, self.error = call(), None
        except Exception as exc:  # replayed at ray.get, as Ray does
            self.value, self.error = None, exc

    def get(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


class _Method:
    def __init__(self, fn: Callable[..., Any], failures: list[BaseException]) -> None:
        self.fn, self.failures = fn, failures

    def remote(self, *args: Any) -> _Ref:
        if self.failures:
            error = self.failures.pop(0)

            def fail() -> None:
                raise error
            return _Ref(fail)
        return _Ref(lambda: self.fn(*args))


class _FlakyHandle:
    """A coordinator handle that raises the queued errors before it answers again."""

    def __init__(self) -> None:
        self.coord = IndexCoordinator()
        self.pull_failures: list[BaseException] = []
        self.publish_failures: list[BaseException] = []
        self.hanging_pulls = 0
        self.lookups: dict[str, _FlakyHandle] = {"handle": self}  # what a lookup by name finds

    @property
    def pull(self) -> Any:
        if self.hanging_pulls:
            self.hanging_pulls -= 1
            return SimpleNamespace(remote=lambda *args: _HangingRef())
        return _Method(self.coord.pull, self.pull_failures)

    @property
    def publish(self) -> _Method:
        return _Method(self.coord.publish, self.publish_failures)

    @property
    def get_retain_steps(self) -> _Method:
        return _Method(self.coord.get_retain_steps, [])


class _Sink:
    def __init__(self) -> None:
        self.got: list[list[int]] = []

    def add_sequences(self, groups: list, seqs: list) -> None:
        self.got += [list(s) for s in seqs]


class _HangingRef:
    """A call whose coordinator never answers: ``ray.get`` waits out its timeout (without one it
    would wait for good; here 30 s, beyond any test's patience)."""

    def get(self, timeout: Any = None) -> Any:
        time.sleep(30.0 if timeout is None else min(timeout, 30.0))
        raise ray.exceptions.GetTimeoutError(f"no answer within {timeout} s")


def _fake_get(refs: Any, timeout: Any = None) -> Any:
    if isinstance(refs, _HangingRef):
        return refs.get(timeout)
    return [r.get() for r in refs] if isinstance(refs, list) else refs.get()


def _fake_wait(refs: list, num_returns: int, timeout: Any) -> tuple[list, list]:
    """Ray's ``wait`` at its timeout: a ``_PendingRef`` not yet settled is still pending."""
    return [r for r in refs if getattr(r, "done", True)], [r for r in refs if not getattr(r, "done", True)]


class _PendingRef:
    """A publish its coordinator has not answered yet; ``settle`` gives it its answer."""

    def __init__(self) -> None:
        self.done, self.error = False, None

    def settle(self, error: BaseException | None = None) -> None:
        self.done, self.error = True, error

    def get(self) -> int:
        if not self.done:
            raise ray.exceptions.GetTimeoutError("no answer yet")
        if self.error is not None:
            raise self.error
        return 0


@pytest.fixture
def handle(monkeypatch: pytest.MonkeyPatch) -> _FlakyHandle:
    fake = _FlakyHandle()
    monkeypatch.setattr(shared_index, "coordinator_handles", lambda *a: [fake.lookups["handle"]])
    monkeypatch.setattr(ray, "get", _fake_get)
    monkeypatch.setattr(ray, "wait", _fake_wait)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    return fake


def _client(max_pull_errors: int = 3, pull_timeout_s: float = 60.0) -> tuple[SharedIndexClient, _Sink]:
    sink = _Sink()
    cfg = SharedIndexConfig(replica_id=0, num_replicas=2, poll_interval_s=0.001, max_poll_interval_s=0.004,
                            max_pull_errors=max_pull_errors, pull_timeout_s=pull_timeout_s)
    return SharedIndexClient(sink, cfg), sink


def _publish_for_replica_0(coord: IndexCoordinator, step: int, first_token: int) -> None:
    bucket = pack([7], [np.array([first_token, 2, 3])])
    coord.publish(1, step, [0], [len(bucket)], bucket)


def _unavailable() -> BaseException:
    return ray.exceptions.ActorUnavailableError("the coordinator is restarting", None)


def test_a_transient_failure_is_retried_counted_and_logged(handle: _FlakyHandle, caplog) -> None:
    handle.pull_failures += [ray.exceptions.GetTimeoutError("slow"), _unavailable()]
    client, sink = _client(max_pull_errors=3)
    _publish_for_replica_0(handle.coord, 0, 100)
    with caplog.at_level(logging.WARNING, logger=shared_index.__name__):
        wait_until(lambda: sink.got == [[100, 2, 3]], "the puller did not recover after two failed pulls")
    stats = client.stats()  # no error: the client keeps working
    assert stats["pull_errors"] == 2
    assert sum("pull of replica 0 failed" in r.getMessage() for r in caplog.records) == 2
    client.record(5, [1, 2])
    client.publish(1)
    client.close()


def test_the_limit_of_failures_in_a_row_stops_the_puller_and_restart_recovers(handle: _FlakyHandle) -> None:
    handle.pull_failures += [_unavailable() for _ in range(3)]
    client, sink = _client(max_pull_errors=3)
    wait_until(lambda: client._error is not None, "three failures in a row did not stop the puller")
    with pytest.raises(RuntimeError, match="puller thread failed") as err:
        client.publish(0)
    assert isinstance(err.value.__cause__, ray.exceptions.ActorUnavailableError)
    _publish_for_replica_0(handle.coord, 0, 100)
    client.restart()
    wait_until(lambda: sink.got == [[100, 2, 3]], "the restarted puller did not pull")
    assert client.stats()["pull_errors"] == 3 and client.stats()["puller_failed"] == 0.0
    assert client.puller_error is None
    with pytest.raises(RuntimeError, match="is running"):
        client.restart()
    client.close()


def test_restart_keeps_the_cursor(handle: _FlakyHandle) -> None:
    """Nothing ingested before the stop is ingested again after restart()."""
    client, sink = _client()
    _publish_for_replica_0(handle.coord, 0, 100)
    wait_until(lambda: len(sink.got) == 1, "the first publication was not pulled")
    client.close()
    _publish_for_replica_0(handle.coord, 1, 200)
    client.restart()
    wait_until(lambda: len(sink.got) == 2, "the second publication was not pulled")
    time.sleep(0.05)
    assert sink.got == [[100, 2, 3], [200, 2, 3]]
    client.close()


@pytest.mark.parametrize("error", [
    TypeError("bad argument"),
    ray.exceptions.RayTaskError("pull", "traceback", ValueError("cursor must be >= -1")).as_instanceof_cause(),
], ids=["local-type-error", "coordinator-value-error"])
def test_an_error_that_cannot_pass_stops_the_puller_at_once(handle: _FlakyHandle, error: BaseException) -> None:
    handle.pull_failures.append(error)
    client, _ = _client(max_pull_errors=1000)
    wait_until(lambda: client._error is not None, "the puller kept running after a non-transient error")
    assert client._error is error
    assert client._stats["pull_errors"] == 0
    with pytest.raises(RuntimeError, match="puller thread failed"):
        client.publish(0)


@pytest.mark.parametrize("wrapped", [False, True], ids=["client", "sharing-drafter"])
def test_a_client_dropped_without_close_is_collected_and_its_puller_stops(
        handle: _FlakyHandle, wrapped: bool) -> None:
    """The puller's thread held the client, so a client its owner dropped without close() was never
    collected and pulled for good. The pause is long: the client's collection must wake the puller."""
    _publish_for_replica_0(handle.coord, 0, 100)
    sink = _Sink()
    cfg = SharedIndexConfig(replica_id=0, num_replicas=2, poll_interval_s=60.0, max_poll_interval_s=60.0)
    client = SharedIndexClient(sink, cfg)
    owner = SharingDrafter(sink, client) if wrapped else client
    wait_until(lambda: sink.got == [[100, 2, 3]], "the first publication was not pulled")
    puller, collected = client._thread, weakref.ref(client)
    del client, owner
    gc.collect()
    puller.join(timeout=5.0)
    assert collected() is None, "something still holds the dropped client"
    assert not puller.is_alive(), "the dropped client's puller kept running"


def test_a_publish_the_coordinator_lost_is_counted_not_resent(handle: _FlakyHandle, caplog) -> None:
    handle.publish_failures.append(ray.exceptions.ActorDiedError())
    client, _ = _client()
    client.record(5, [1, 2])
    with caplog.at_level(logging.WARNING, logger=shared_index.__name__):
        client.publish(3)
        wait_until(lambda: client.stats()["publish_errors"] == 1, "the lost publish was not counted")
    assert any("publish of step 3 by replica 0" in r.getMessage() and "lost" in r.getMessage()
               for r in caplog.records)
    assert handle.coord.stats()["publishes"] == 0  # not resent
    client.record(5, [1, 2])
    client.publish(4)  # the client goes on
    client.flush()
    assert handle.coord.stats()["publishes"] == 1
    client.close()


def _replace_after_three_pulled(handle: _FlakyHandle, fresh: _FlakyHandle) -> tuple[SharedIndexClient, _Sink]:
    """A client that pulled three publications from ``handle``, whose coordinator then dies and
    is replaced by ``fresh`` (holding one publication, step 3); returns once it is pulled."""
    client, sink = _client()
    for step in range(3):
        _publish_for_replica_0(handle.coord, step, 100 + step)
    wait_until(lambda: len(sink.got) == 3, "the first publications were not pulled")
    _publish_for_replica_0(fresh.coord, 3, 200)
    handle.lookups["handle"] = fresh  # what the lookup after the failed pull below finds
    handle.pull_failures.append(ray.exceptions.ActorDiedError())
    wait_until(lambda: len(sink.got) == 4, "the replaced coordinator's publication was skipped")
    assert sink.got[-1] == [200, 2, 3]
    return client, sink


def test_a_replaced_coordinator_is_pulled_from_the_start(handle: _FlakyHandle) -> None:
    """A coordinator restarted by Ray (or replaced by the driver) numbers publications from 0
    again; the old cursor would skip the new one's first publications."""
    client, _ = _replace_after_three_pulled(handle, _FlakyHandle())
    stats = client.stats()
    assert stats["coordinator_resets"] == 1 and stats["pull_errors"] == 1
    client.close()


class _WrappedPull(_FlakyHandle):
    """A handle whose ``pull.remote`` goes through ``_pull`` (given the plain handle's call), for
    stand-ins that alter one pull."""

    @property
    def pull(self) -> Any:
        inner = super().pull
        return SimpleNamespace(remote=lambda *args: self._pull(inner.remote, *args))

    def _pull(self, inner: Callable[..., Any], *args: Any) -> Any:
        """The pull as this stand-in answers it; the plain handle's here."""
        return inner(*args)


class _FailFromTheStart(_WrappedPull):
    """A handle whose first pull from the start (cursor -1) fails as a dying actor's would."""

    def __init__(self) -> None:
        super().__init__()
        self.failed = False

    def _pull(self, inner: Callable[..., Any], dest: int, cursor: int, *args: Any) -> Any:
        if cursor == -1 and not self.failed:
            self.failed = True
            return _Method(self.coord.pull, [ray.exceptions.ActorDiedError()]).remote()
        return inner(dest, cursor, *args)


def test_a_reset_whose_pull_from_the_start_fails_is_counted_once_and_read_from_the_start(
        handle: _FlakyHandle) -> None:
    """The retry after a failed pull from the start saw the reset again and counted it twice;
    it must still pull from the start, not from the old coordinator's cursor."""
    fresh = _FailFromTheStart()
    client, _ = _replace_after_three_pulled(handle, fresh)
    assert fresh.failed
    stats = client.stats()
    assert stats["coordinator_resets"] == 1 and stats["pull_errors"] == 2
    client.close()


class _PublishDuringPull(_WrappedPull):
    """A handle whose next pull runs ``before_pull`` once after the client sent its arguments, as
    an owner that publishes while the puller's pull is on its way (its publish arrives first)."""

    def __init__(self) -> None:
        super().__init__()
        self.before_pull: Callable[[], Any] | None = None

    def _pull(self, inner: Callable[..., Any], *args: Any) -> Any:
        if self.before_pull is not None:
            run, self.before_pull = self.before_pull, None
            run()
        return inner(*args)


class _CorruptOnce(_WrappedPull):
    """A handle whose next pull answers with its payload cut short by one element."""

    def __init__(self) -> None:
        super().__init__()
        self.corrupt = True

    def _pull(self, inner: Callable[..., Any], *args: Any) -> Any:
        ref = inner(*args)
        if self.corrupt and ref.error is None:
            self.corrupt, got = False, ref.value
            ref.value = Pulled(got.head, got.latest_step, got.entries, got.payload[:-1],
                               got.over_budget, got.instance)
        return ref


def test_a_corrupt_pull_moves_no_cursor(handle: _FlakyHandle) -> None:
    """The cursor moved to the reply's head before its buckets were unpacked: the pull that
    raised "corrupt bucket" skipped them for good, and the first one also fixed step_at_join."""
    corrupt = _CorruptOnce()
    handle.lookups["handle"] = corrupt
    _publish_for_replica_0(corrupt.coord, 2, 100)
    client = SharedIndexClient(_Sink(), SharedIndexConfig(replica_id=0, num_replicas=2), start=False)
    with pytest.raises(ValueError, match="corrupt bucket"):
        client.poll()
    assert (client._cursor, client.step_at_join, client.latest_step) == (-1, -1, -1)
    assert client.poll() == 1 and client.step_at_join == 2
    client.apply()
    assert client.drafter.got == [[100, 2, 3]]


def test_an_own_publish_that_lands_before_a_pull_from_the_start_is_not_ingested(handle: _FlakyHandle) -> None:
    """A pull from the start (the first, or after a coordinator reset) leaves out the steps this
    process published; one published after the pull sent its list came back and was ingested,
    so this replica indexed its own responses twice."""
    racing = _PublishDuringPull()
    handle.lookups["handle"] = racing
    sink = _Sink()
    client = SharedIndexClient(sink, SharedIndexConfig(replica_id=0, num_replicas=2, affinity_k=2), start=False)
    client.record(5, [1, 2, 3])  # group 5 goes to both replicas, this one included
    racing.before_pull = lambda: client.publish(0)
    client.poll()
    client.apply()
    assert racing.coord.stats()["publishes"] == 1  # the publish reached the coordinator first
    assert sink.got == []
    assert client.stats()["entries_fetched"] == 0


@pytest.mark.parametrize("value, exc", [(0, ValueError), (1_000_001, ValueError), (2.0, TypeError)])
def test_max_pull_errors_is_checked(value: Any, exc: type) -> None:
    with pytest.raises(exc, match="max_pull_errors"):
        SharedIndexConfig(replica_id=0, num_replicas=1, max_pull_errors=value)


def test_a_pull_that_hangs_times_out_and_is_retried(handle: _FlakyHandle) -> None:
    """A coordinator that hangs without failing used to hold the puller for good."""
    handle.hanging_pulls = 1
    client, sink = _client(pull_timeout_s=0.05)
    _publish_for_replica_0(handle.coord, 0, 100)
    wait_until(lambda: sink.got == [[100, 2, 3]], "the puller stayed on the hanging pull")
    assert client.stats()["pull_errors"] == 1
    client.close()


@pytest.mark.parametrize("value, exc", [(0.0, ValueError), (86401.0, ValueError), ("1", TypeError)])
def test_pull_timeout_s_is_checked(value: Any, exc: type) -> None:
    with pytest.raises(exc, match=r"pull_timeout_s must be"):
        SharedIndexConfig(replica_id=0, num_replicas=1, pull_timeout_s=value)


class _DeadHandle(_FlakyHandle):
    """The handle of a coordinator that died: every publish through it fails."""

    @property
    def publish(self) -> _Method:
        return _Method(self.coord.publish, [ray.exceptions.ActorDiedError()])


def test_a_publish_lost_to_another_shard_that_died_looks_up_its_replacement(
        handle: _FlakyHandle, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard this replica only publishes to (it pulls from its own) died and the driver replaced
    it: only a failed pull looked the coordinators up again, so every later publish went to the
    dead handle and was lost for good."""
    dead, fresh = _DeadHandle(), _FlakyHandle()
    found = {"shard 1": fresh}  # the driver's replacement, under the dead one's name
    monkeypatch.setattr(shared_index, "coordinator_handles", lambda *a: [handle, found["shard 1"]])
    sink = _Sink()
    cfg = SharedIndexConfig(replica_id=0, num_replicas=2, num_shards=2, affinity_k=2,
                            poll_interval_s=0.001, max_poll_interval_s=0.004)
    found["shard 1"] = dead
    client = SharedIndexClient(sink, cfg)
    found["shard 1"] = fresh
    client.record(5, [1, 2])  # group 5 goes to both replicas: shard 0 (ours) and shard 1
    client.publish(0)
    wait_until(lambda: client.stats()["publish_errors"] == 1, "the publish to the dead shard was not counted")
    client.record(5, [1, 2])
    client.publish(1)  # the fake handles run the call at once
    assert fresh.coord.stats()["publishes"] == 1  # the next step's publish reached the replacement
    client.flush()
    assert client.stats()["publish_errors"] == 1
    client.close()


def _unstarted_client() -> SharedIndexClient:
    """A client without its puller, so that only the test reaps its publishes."""
    return SharedIndexClient(_Sink(), SharedIndexConfig(replica_id=0, num_replicas=2), start=False)


def test_flush_counts_a_publish_lost_to_an_error_that_passes(handle: _FlakyHandle, caplog) -> None:
    """flush used to re-raise the lost publish's error, where the puller counts and logs it."""
    handle.publish_failures.append(ray.exceptions.ActorDiedError())
    client = _unstarted_client()
    client.record(5, [1, 2])
    client.publish(3)
    with caplog.at_level(logging.WARNING, logger=shared_index.__name__):
        client.flush()
    assert client.stats()["publish_errors"] == 1
    assert any("publish of step 3 by replica 0" in r.getMessage() for r in caplog.records)


def test_a_publish_unfinished_at_the_flush_timeout_stays_in_flight(
        handle: _FlakyHandle, monkeypatch: pytest.MonkeyPatch) -> None:
    """flush took every publish out of flight before waiting: one that finished after its timeout
    was never checked, so its loss went uncounted."""
    pending = _PendingRef()
    monkeypatch.setattr(_FlakyHandle, "publish", property(lambda self: SimpleNamespace(remote=lambda *a: pending)))
    client = _unstarted_client()
    client.record(5, [1, 2])
    client.publish(3)
    with pytest.raises(TimeoutError, match="1 publishes of replica 0 are still in flight"):
        client.flush(timeout_s=0.0)
    pending.settle(ray.exceptions.ActorDiedError())
    client.poll()  # the puller's round reaps it
    assert client.stats()["publish_errors"] == 1
    client.flush()  # nothing left in flight


def test_fetched_counters_leave_out_the_own_entries_that_came_back(handle: _FlakyHandle) -> None:
    """fetched_tokens and entries_fetched left out this process's own entries that came back
    (a pull from the start that an own publish overtook) but fetched_bytes counted them."""
    racing = _PublishDuringPull()
    handle.lookups["handle"] = racing
    _publish_for_replica_0(racing.coord, 0, 100)  # a peer's bucket of 3 tokens for this replica
    peer_bytes = racing.coord.pull(0, -1, 1 << 20, None).payload.nbytes
    client = _unstarted_client()
    client.record(5, [1, 2, 3])  # group 5 goes to both replicas, this one included
    racing.before_pull = lambda: client.publish(0)
    client.poll()
    stats = client.stats()
    assert (stats["entries_fetched"], stats["fetched_tokens"], stats["fetched_bytes"]) == (1, 3, peer_bytes)


def _coordinator_error() -> BaseException:
    """An error raised by the coordinator's own code: it cannot pass."""
    cause = ValueError("lengths do not add up")
    return ray.exceptions.RayTaskError("publish", "traceback", cause).as_instanceof_cause()


def _publish_steps(client: SharedIndexClient, steps: range) -> None:
    """One publish per step (one shard: one call each), none reaped yet."""
    for step in steps:
        client.record(5, [1, 2])
        client.publish(step)


def test_a_reap_counts_every_lost_publish_before_it_raises(handle: _FlakyHandle, caplog) -> None:
    """A publish error that cannot pass was raised at once: the lost publishes finished in the
    same reap were taken out of flight but never counted nor logged."""
    error = _coordinator_error()
    handle.publish_failures += [error, ray.exceptions.ActorDiedError()]
    client = _unstarted_client()
    _publish_steps(client, range(2))
    with caplog.at_level(logging.WARNING, logger=shared_index.__name__), \
            pytest.raises(ValueError) as raised:
        client.flush()
    assert raised.value is error
    assert client.stats()["publish_errors"] == 1
    assert any("publish of step 1 by replica 0" in r.getMessage() and "lost" in r.getMessage()
               for r in caplog.records)
    client.flush()  # nothing left in flight


def test_a_second_publish_error_that_cannot_pass_is_logged(handle: _FlakyHandle, caplog) -> None:
    """Only the first publish error that cannot pass of a reap was seen; the second was dropped
    without a trace."""
    first, second = TypeError("first"), TypeError("second")
    handle.publish_failures += [first, second]
    client = _unstarted_client()
    _publish_steps(client, range(2))
    with caplog.at_level(logging.WARNING, logger=shared_index.__name__), \
            pytest.raises(TypeError) as raised:
        client.flush()
    assert raised.value is first
    assert any(r.levelno == logging.ERROR and "publish of step 1 by replica 0" in r.getMessage()
               and "second" in r.getMessage() for r in caplog.records)
    assert client.stats()["publish_errors"] == 0


def test_one_coordinator_lookup_per_reap_that_lost_publishes(
        handle: _FlakyHandle, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every lost publish looked the coordinators up again (a Ray name lookup per shard)."""
    lookups: list[int] = []

    def look_up(*args: Any) -> list[_FlakyHandle]:
        lookups.append(1)
        return [handle]
    monkeypatch.setattr(shared_index, "coordinator_handles", look_up)
    client = _unstarted_client()
    _publish_steps(client, range(2))
    client.flush()
    assert len(lookups) == 1  # the client's own, at construction: nothing lost, nothing looked up
    handle.publish_failures += [ray.exceptions.ActorDiedError() for _ in range(3)]
    _publish_steps(client, range(2, 5))
    client.flush()
    assert client.stats()["publish_errors"] == 3
    assert len(lookups) == 2


def _stopped_client(handle: _FlakyHandle, **options: Any) -> tuple[SharedIndexClient, _Sink]:
    """A client whose puller stopped at its first (failed) pull; ``options`` go to its config."""
    handle.pull_failures.append(_unavailable())
    sink = _Sink()
    cfg = SharedIndexConfig(replica_id=0, num_replicas=2, poll_interval_s=0.001, max_poll_interval_s=0.004,
                            max_pull_errors=1, **options)
    client = SharedIndexClient(sink, cfg)
    wait_until(lambda: client._error is not None, "the failed pull did not stop the puller")
    return client, sink


def _publish_raising(client: SharedIndexClient, step: int, *responses: tuple[int, list[int]]) -> None:
    for group, tokens in responses:
        client.record(group, tokens)
    with pytest.raises(RuntimeError, match="puller thread failed"):
        client.publish(step)


def _steps_received(coord: IndexCoordinator, dest: int) -> list[tuple[int, list[list[int]]]]:
    """(step, responses) of every publication ``coord`` keeps for ``dest``, in arrival order."""
    got = coord.pull(dest, -1, own_steps=[])
    return [(e.step, unpack(b)[1]) for e, b in zip(got.entries, got.buckets())]


def test_the_responses_of_publishes_that_raised_go_out_under_their_own_steps_after_restart(
        handle: _FlakyHandle) -> None:
    """A publish that raised kept its responses in ``_recorded``: they piled up step after step,
    and the first publish after restart() sent them all labelled with its own (newer) step."""
    client, _ = _stopped_client(handle)
    _publish_raising(client, 3, (5, [1, 2]))
    _publish_raising(client, 4, (6, [3, 4]), (6, [5, 6]))
    client.restart()
    client.record(7, [7, 8])
    cost = client.publish(5)
    client.flush()
    for dest in (0, 1):  # affinity_k=2 of 2 replicas: both get every group
        assert _steps_received(handle.coord, dest) == [(3, [[1, 2]]), (4, [[3, 4], [5, 6]]), (5, [[7, 8]])]
    assert cost["tokens"] == 8
    stats = client.stats()
    assert stats["publishes"] == 3 and stats["backlog_sequences_dropped"] == 0
    client.record(8, [9])
    client.publish(6)  # the backlog went out once
    client.flush()
    assert [step for step, _ in _steps_received(handle.coord, 1)] == [3, 4, 5, 6]
    client.close()


def test_the_backlog_keeps_the_newest_retain_steps_steps_and_counts_the_dropped(
        handle: _FlakyHandle, caplog) -> None:
    """An owner that kept ending steps without restart() made the client hold every response."""
    handle.coord = IndexCoordinator(retain_steps=2)
    client, _ = _stopped_client(handle)
    assert client.retain_steps == 2
    with caplog.at_level(logging.WARNING, logger=shared_index.__name__):
        for step in range(4):
            _publish_raising(client, step, (5, [step, 100]), (6, [step, 200]))
    assert sorted(client._backlog) == [2, 3]
    assert sum("dropped the 2 responses of step" in r.getMessage() for r in caplog.records) == 2
    client.restart()
    with caplog.at_level(logging.WARNING, logger=shared_index.__name__):
        client.publish(4)  # nothing recorded in step 4: step 2 falls out of the window
    client.flush()
    assert _steps_received(handle.coord, 1) == [(3, [[3, 100], [3, 200]])]
    assert client.stats()["backlog_sequences_dropped"] == 6
    client.close()


def _replaced_by(handle: _FlakyHandle, retain_steps: int) -> _FlakyHandle:
    """The driver's new coordinator, created with ``retain_steps``: what a lookup finds from now."""
    fresh = _FlakyHandle()
    fresh.coord = IndexCoordinator(retain_steps=retain_steps)
    handle.lookups["handle"] = fresh
    return fresh


def test_restart_reads_a_larger_retain_steps_and_keeps_the_steps_it_allows(handle: _FlakyHandle) -> None:
    """restart() kept the retain_steps read at construction: coordinators re-created with a larger
    one would have kept steps that the client dropped from its backlog at the next publish."""
    handle.coord = IndexCoordinator(retain_steps=2)
    client, _ = _stopped_client(handle)
    for step in range(2):
        _publish_raising(client, step, (5, [step, 100]))
    fresh = _replaced_by(handle, retain_steps=3)
    client.restart()
    assert client.retain_steps == 3
    client.record(5, [2, 100])
    client.publish(2)
    client.flush()
    assert _steps_received(fresh.coord, 1) == [(0, [[0, 100]]), (1, [[1, 100]]), (2, [[2, 100]])]
    assert client.stats()["backlog_sequences_dropped"] == 0
    client.close()


def test_restart_reads_a_smaller_retain_steps_and_trims_the_backlog_at_once(
        handle: _FlakyHandle, caplog) -> None:
    """Under the old, larger retain_steps the publish after restart() sent steps that the new
    coordinators evict as their window moves (or refuse as stale when a peer is ahead)."""
    client, _ = _stopped_client(handle)  # retain_steps=4
    for step in range(4):
        _publish_raising(client, step, (5, [step, 100]))
    fresh = _replaced_by(handle, retain_steps=2)
    with caplog.at_level(logging.WARNING, logger=shared_index.__name__):
        client.restart()
    assert client.retain_steps == 2 and sorted(client._backlog) == [2, 3]
    assert client.stats()["backlog_sequences_dropped"] == 2
    assert sum("outside the newest retain_steps=2 steps" in r.getMessage() for r in caplog.records) == 2
    client.record(5, [4, 100])
    client.publish(4)  # step 2 falls out of the new window
    client.flush()
    assert _steps_received(fresh.coord, 1) == [(3, [[3, 100]]), (4, [[4, 100]])]
    assert fresh.coord.stats()["publishes"] == 2  # nothing sent only to be evicted
    client.close()


def test_a_restart_whose_coordinators_keep_another_retain_steps_than_the_config_changes_nothing(
        handle: _FlakyHandle) -> None:
    """A config naming retain_steps was checked at construction only: restart() went on with
    coordinators that keep another number of steps."""
    client, _ = _stopped_client(handle, retain_steps=4)
    _publish_raising(client, 0, (5, [1, 2]))
    _replaced_by(handle, retain_steps=2)
    with pytest.raises(ValueError, match=r"retain_steps=4 but the coordinators 'rollout-spec-index' keep 2"):
        client.restart()
    assert client.retain_steps == 4 and sorted(client._backlog) == [0]
    assert client.stats()["puller_failed"] == 1.0
    _replaced_by(handle, retain_steps=4)  # the driver re-creates them as the config says
    client.restart()
    assert client.stats()["puller_failed"] == 0.0
    client.close()


class _NgramLike(_Sink):
    """The drafter calls SharingDrafter.stats makes."""

    def stats(self) -> dict:
        return {"step": 0}


def test_stats_answer_while_the_puller_is_stopped(handle: _FlakyHandle) -> None:
    """stats() raised the puller's error, so an owner whose step boundary raised it could not even
    log what the backlog dropped; publish and close still raise it."""
    handle.coord = IndexCoordinator(retain_steps=1)
    client, _ = _stopped_client(handle)
    _publish_raising(client, 0, (5, [1, 2]))
    _publish_raising(client, 1, (6, [3, 4]), (6, [5, 6]))  # step 0 falls out of the window
    stats = client.stats()
    assert (stats["puller_failed"], stats["backlog_sequences_dropped"], stats["backlog_sequences"]) == (1.0, 1, 2)
    assert isinstance(client.puller_error, ray.exceptions.ActorUnavailableError)
    owner = SharingDrafter(_NgramLike(), client)
    assert owner.stats()["shared_index/puller_failed"] == 1.0
    with pytest.raises(RuntimeError, match="puller thread failed"):
        client.close()


class _FailingSubmit(_FlakyHandle):
    """A handle whose ``publish.remote`` raises at once on the calls numbered in ``fail_calls``
    (from 1), as a Ray call that cannot be submitted does."""

    def __init__(self, fail_calls: set[int]) -> None:
        super().__init__()
        self.fail_calls, self.calls = fail_calls, 0

    @property
    def publish(self) -> Any:
        inner = super().publish

        def remote(*args: Any) -> Any:
            self.calls += 1
            if self.calls in self.fail_calls:
                raise ConnectionError("the call could not be submitted")
            return inner.remote(*args)
        return SimpleNamespace(remote=remote)


def test_a_submit_that_raises_keeps_the_steps_not_yet_submitted(handle: _FlakyHandle) -> None:
    """The backlog was emptied before it was sent: a submit that raised on its 2nd of 3 steps lost
    that step's responses and the next one's."""
    flaky = _FailingSubmit(fail_calls={2})
    handle.lookups["handle"] = flaky
    flaky.pull_failures.append(_unavailable())
    sink = _Sink()
    client = SharedIndexClient(sink, SharedIndexConfig(replica_id=0, num_replicas=2, max_pull_errors=1))
    wait_until(lambda: client._error is not None, "the failed pull did not stop the puller")
    _publish_raising(client, 3, (5, [1, 2]))
    _publish_raising(client, 4, (6, [3, 4]))
    client.restart()
    client.record(7, [5, 6])
    with pytest.raises(ConnectionError, match="could not be submitted"):
        client.publish(5)  # step 3 goes out, step 4's submit raises
    assert sorted(client._backlog) == [4, 5]
    assert client.stats()["publishes"] == 1 and client.stats()["backlog_sequences"] == 2
    client.publish(6)
    client.flush()
    assert _steps_received(flaky.coord, 1) == [(3, [[1, 2]]), (4, [[3, 4]]), (5, [[5, 6]])]
    assert client._backlog == {} and client.stats()["publishes"] == 4
    client.close()


def _three_shards(handle: _FlakyHandle, monkeypatch: pytest.MonkeyPatch,
                  failing: set[int]) -> tuple[SharedIndexClient, list[_FailingSubmit]]:
    """An unstarted client of replica 0 of 3 on 3 coordinator shards, each response going to all 3
    replicas (so to every shard, replica r on shard r); the first submit to a shard in ``failing``
    raises."""
    shards = [_FailingSubmit(fail_calls={1} if s in failing else set()) for s in range(3)]
    monkeypatch.setattr(shared_index, "coordinator_handles", lambda *a: shards)
    cfg = SharedIndexConfig(replica_id=0, num_replicas=3, affinity_k=3, num_shards=3)
    return SharedIndexClient(_Sink(), cfg, start=False), shards


def _publish_failing_on_shard_2(client: SharedIndexClient, step: int, *responses: tuple[int, list[int]]) -> None:
    for group, tokens in responses:
        client.record(group, tokens)
    with pytest.raises(ConnectionError, match="could not be submitted"):
        client.publish(step)  # shards 0 and 1 take the step, shard 2's submit raises


def test_a_step_some_shards_took_before_a_submit_raised_goes_only_to_the_others(
        handle: _FlakyHandle, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole step stayed in the backlog: the next publish sent it to every shard again, so the
    shards that took it before the failure held each response twice."""
    client, shards = _three_shards(handle, monkeypatch, failing={2})
    _publish_failing_on_shard_2(client, 3, (5, [1, 2]), (6, [3, 4, 5]))
    assert [s.calls for s in shards] == [1, 1, 1]
    assert client.stats()["backlog_sequences"] == 2  # shard 2 still has to take them
    client.publish(4)
    client.flush()
    assert [s.calls for s in shards] == [1, 1, 2]
    for dest, shard in enumerate(shards):
        assert _steps_received(shard.coord, dest) == [(3, [[1, 2], [3, 4, 5]])]
    assert client._backlog == {}


def test_responses_recorded_for_a_partly_sent_step_reach_every_shard_once(
        handle: _FlakyHandle, monkeypatch: pytest.MonkeyPatch) -> None:
    """New responses joined the step's old ones, and the step went out whole: to the shards that
    had taken the old ones too."""
    client, shards = _three_shards(handle, monkeypatch, failing={2})
    _publish_failing_on_shard_2(client, 3, (5, [1, 2]))
    client.record(6, [3, 4])  # more for step 3: every shard needs these, only shard 2 the first
    client.publish(3)
    client.flush()
    for dest in (0, 1):
        assert _steps_received(shards[dest].coord, dest) == [(3, [[1, 2]]), (3, [[3, 4]])]
    assert _steps_received(shards[2].coord, 2) == [(3, [[1, 2], [3, 4]])]
    assert client._backlog == {}


def test_a_second_publish_that_fails_part_way_leaves_each_shard_what_it_did_not_take(
        handle: _FlakyHandle, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two publishes of one step that raised on different shards, then one that succeeds: each
    shard ends with every response once."""
    client, shards = _three_shards(handle, monkeypatch, failing={2})
    _publish_failing_on_shard_2(client, 3, (5, [1, 2]))
    shards[1].fail_calls = {2}  # shard 1's next submit raises, after shard 0 took the new response
    client.record(6, [3, 4])
    with pytest.raises(ConnectionError, match="could not be submitted"):
        client.publish(3)
    assert client.stats()["backlog_sequences"] == 2
    client.publish(4)
    client.flush()
    assert _steps_received(shards[0].coord, 0) == [(3, [[1, 2]]), (3, [[3, 4]])]
    assert _steps_received(shards[1].coord, 1) == [(3, [[1, 2]]), (3, [[3, 4]])]
    assert _steps_received(shards[2].coord, 2) == [(3, [[1, 2], [3, 4]])]
    assert client._backlog == {} and client.stats()["published_tokens"] == 4


def test_the_publish_counters_count_what_was_submitted(handle: _FlakyHandle, monkeypatch: pytest.MonkeyPatch) -> None:
    """A publish whose submit raised counted nothing of what its other shards took, and the next
    one counted the step whole; a response's tokens count once, however many shards hold it."""
    client, _ = _three_shards(handle, monkeypatch, failing={2})
    bucket_bytes = pack(np.array([5, 6]), [np.array([1, 2]), np.array([3, 4, 5])]).nbytes  # one per replica
    _publish_failing_on_shard_2(client, 3, (5, [1, 2]), (6, [3, 4, 5]))
    stats = client.stats()
    assert (stats["published_bytes"], stats["published_tokens"], stats["publishes"]) == (2 * bucket_bytes, 5, 0)
    cost = client.publish(4)  # shard 2 takes step 3; step 4 has no responses
    assert (cost["bytes"], cost["tokens"], cost["buckets"]) == (bucket_bytes, 0, 1)
    stats = client.stats()
    assert (stats["published_bytes"], stats["published_tokens"], stats["publishes"]) == (3 * bucket_bytes, 5, 2)


def test_the_client_reads_retain_steps_from_the_coordinators(handle: _FlakyHandle) -> None:
    """The client's retain_steps had to be passed by hand to match the coordinators'; a value the
    driver chose (not history_steps) left the client bounding its backlog by another."""
    handle.coord = IndexCoordinator(retain_steps=7)
    assert _unstarted_client().retain_steps == 7
    with pytest.raises(ValueError, match=r"retain_steps=3 but the coordinators 'rollout-spec-index' keep 7"):
        SharedIndexClient(_Sink(), SharedIndexConfig(replica_id=0, num_replicas=2, retain_steps=3), start=False)
    agreeing = SharedIndexConfig(replica_id=0, num_replicas=2, retain_steps=7)
    assert SharedIndexClient(_Sink(), agreeing, start=False).retain_steps == 7


def test_coordinator_shards_that_disagree_on_retain_steps_are_refused(
        handle: _FlakyHandle, monkeypatch: pytest.MonkeyPatch) -> None:
    other = _FlakyHandle()
    other.coord = IndexCoordinator(retain_steps=2)
    monkeypatch.setattr(shared_index, "coordinator_handles", lambda *a: [handle, other])
    cfg = SharedIndexConfig(replica_id=0, num_replicas=2, num_shards=2)
    with pytest.raises(ValueError, match=r"shards disagree on retain_steps: \[4, 2\]"):
        SharedIndexClient(_Sink(), cfg, start=False)


def test_share_drafter_leaves_retain_steps_to_the_coordinators(monkeypatch: pytest.MonkeyPatch) -> None:
    """share_drafter gave the client max(1, history_steps), wrong for a driver that passed its own
    value to ensure_coordinators; a retain_steps client option still reaches the config."""
    from rollout_spec.config import SpecConfig
    from rollout_spec.distributed import sharing
    from rollout_spec.distributed.placement import ReplicaPlacement

    monkeypatch.setattr(sharing, "_join_ray", lambda: None)
    monkeypatch.setattr(sharing, "SharedIndexClient", lambda drafter, config: config)
    spec, placement = SpecConfig(shared_index="x", history_steps=7), ReplicaPlacement(0, 2)
    assert sharing.share_drafter(_Sink(), spec, placement).index.retain_steps is None
    assert sharing.share_drafter(_Sink(), spec, placement, retain_steps=3).index.retain_steps == 3


@pytest.mark.parametrize("value, exc", [(0, ValueError), ((1 << 20) + 1, ValueError), (2.0, TypeError)])
def test_retain_steps_is_checked(value: Any, exc: type) -> None:
    with pytest.raises(exc, match="retain_steps must be"):
        SharedIndexConfig(replica_id=0, num_replicas=1, retain_steps=value)

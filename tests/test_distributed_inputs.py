"""Bad input to the distributed package's public functions is refused, naming the field, before any
state changes; nothing is truncated, wrapped or taken as a bool (no Ray needed)."""
from __future__ import annotations

import json
import threading
import weakref
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np
import pytest

import rollout_spec.distributed.shared_index as shared_index
from rollout_spec.distributed import GroupRouter, group_key
from rollout_spec.distributed.coordinator import IndexCoordinator
from rollout_spec.distributed.keys import mix64, rendezvous_scores
from rollout_spec.distributed.packing import pack, split_by_destination, unpack
from rollout_spec.distributed.placement import ENV_NUM_REPLICAS, ENV_REPLICA_ID, ReplicaPlacement, placement_from_env
from rollout_spec.distributed.shared_index import SharedIndexClient, SharedIndexConfig


def _snapshot(coord: IndexCoordinator) -> tuple:
    stats = {k: v for k, v in coord.stats().items() if not k.endswith("_s")}
    return stats, {d: [e for e, _ in q] for d, q in coord._by_dest.items()}


BUCKET = pack([1], [np.array([1, 2, 3])])


@pytest.mark.parametrize("dests, lengths, payload, exc, field", [
    ([1, 2], [len(BUCKET) + 1, -1], BUCKET, ValueError, "lengths"),  # sums right, one negative
    ([1], [float(len(BUCKET))], BUCKET, TypeError, "lengths"),
    ([1, 2], [2, len(BUCKET) - 2], BUCKET, ValueError, "corrupt bucket"),  # splits a bucket
    ([-3], [len(BUCKET)], BUCKET, ValueError, "dests"),
    ([1.7], [len(BUCKET)], BUCKET, TypeError, "dests"),
    (["x"], [len(BUCKET)], BUCKET, TypeError, "dests"),
    ([1], [len(BUCKET)], BUCKET.astype(np.int64), TypeError, "payload"),
])
def test_rejected_publish_leaves_the_coordinator_as_it_was(dests, lengths, payload, exc, field) -> None:
    coord = IndexCoordinator(2)
    coord.publish(0, 0, [2], [len(BUCKET)], BUCKET)
    before = _snapshot(coord)
    with pytest.raises(exc, match=field):
        coord.publish(0, 1, dests, lengths, payload)
    assert _snapshot(coord) == before
    assert coord.publish(0, 1, [1], [len(BUCKET)], BUCKET) == 2  # the head moves on by one
    assert [unpack(b) for b in coord.pull(1, -1).buckets()] == [([1], [[1, 2, 3]])]


@pytest.mark.parametrize("args, exc, field", [
    ((1, -1, -5), ValueError, "budget_tokens"), ((1, -1, float("nan")), TypeError, "budget_tokens"),
    ((1, None), TypeError, "cursor"), ((1, -2), ValueError, "cursor"), (("x", -1), TypeError, "dest"),
    ((1, -1, None, 5), TypeError, "own_steps"), ((1, -1, None, [1.5]), TypeError, "own_steps"),
])
def test_pull_checks_its_arguments(args: tuple, exc: type, field: str) -> None:
    coord = IndexCoordinator(2)
    coord.publish(0, 0, [1], [len(BUCKET)], BUCKET)
    with pytest.raises(exc, match=field):
        coord.pull(*args)
    assert coord.pull(1, -1, 3).over_budget == 0


class _Sink:
    def __init__(self) -> None:
        self.got: list = []

    def add_sequences(self, groups: list, seqs: list) -> None:
        self.got += list(zip(groups, seqs))


def _client(monkeypatch: pytest.MonkeyPatch) -> SharedIndexClient:
    monkeypatch.setattr(shared_index, "coordinator_handles", lambda *a: [None])
    monkeypatch.setattr(shared_index, "coordinators_retain_steps", lambda *a: 4)
    return SharedIndexClient(_Sink(), SharedIndexConfig(0, 2), start=False)


def test_apply_checks_max_sequences_before_taking_staged_work(monkeypatch: pytest.MonkeyPatch) -> None:
    client = _client(monkeypatch)
    client._staged.append(([1, 2], [[1], [2]]))
    for bad, exc in [(1.5, TypeError), (True, TypeError), ("x", TypeError), (-3, ValueError)]:
        with pytest.raises(exc, match="max_sequences"):
            client.apply(bad)
    assert list(client._staged) == [([1, 2], [[1], [2]])] and client.drafter.got == []
    assert client.apply(0) == 0 and client.apply(1) == 1 and client.apply() == 1
    assert client.drafter.got == [(1, [1]), (2, [2])]


@pytest.mark.parametrize("tokens, exc", [
    ([1.7, 2.9], TypeError), ([[1, 2], [3, 4]], TypeError), ([True, False], TypeError), ([[1], [2, 3]], TypeError),
    (5, TypeError), ([2**40], ValueError), ([-1], ValueError),
])
def test_record_refuses_tokens_it_would_coerce(monkeypatch: pytest.MonkeyPatch, tokens: Any, exc: type) -> None:
    client = _client(monkeypatch)
    with pytest.raises(exc, match="token_ids"):
        client.record(1, tokens)
    assert client._recorded == ([], [])
    buffer = np.array([1, 2], np.int32)
    client.record(np.int64(1), buffer)
    buffer[0] = 9  # the client kept its own copy
    assert type(client._recorded[0][0]) is int and client._recorded[1][0].tolist() == [1, 2]


@pytest.mark.parametrize("call, exc, field", [
    (lambda: pack([1], [np.array([2**40])]), ValueError, r"sequences\[0\] must hold token ids"),
    (lambda: pack([1], [np.array([1.7, 2.9])]), TypeError, r"sequences\[0\] must be a 1-D array of integers"),
    (lambda: pack([1], [np.array([-5, 2])]), ValueError, r"sequences\[0\] must hold token ids"),
    (lambda: pack([1.9], [np.array([1])]), TypeError, "groups"),
    (lambda: pack([True], [np.array([1])]), TypeError, "groups"),
    (lambda: pack(np.array([[1], [2]]), [[1], [2]]), TypeError, "groups"),
    (lambda: pack([1], [np.array([[1, 2], [3, 4]])]), TypeError, "sequences"),
    (lambda: pack([1], [5]), TypeError, "sequences"),
    (lambda: pack([1], [[True, 2]]), TypeError, r"sequences\[0\]"),  # numpy would join True as 1
    (lambda: pack([1, 2], [np.array([3]), np.array([True])]), TypeError, r"sequences\[1\]"),
    (lambda: pack([1, 2], [[3], "ab"]), TypeError, r"sequences\[1\]"),
    (lambda: unpack(np.array([2, 1, 1, -1, 2, 7], np.int32)), ValueError, "corrupt bucket"),  # negative length
    (lambda: unpack(np.array([1, -5, 1, 7], np.int32)), ValueError, "corrupt bucket"),
    (lambda: unpack(np.array([1, 1, 1, -7], np.int32)), ValueError, "corrupt bucket"),
    (lambda: unpack([0]), ValueError, "corrupt bucket"),
    (lambda: split_by_destination(np.array([1]), [np.array([1])], np.array([[-1]])), ValueError, "destinations"),
    (lambda: split_by_destination(np.array([1]), [np.array([1])], np.array([[0.5]])), TypeError, "destinations"),
    (lambda: split_by_destination(np.array([1]), [np.array([1]), np.array([2])], np.array([[0], [1]])),
     ValueError, "groups"),
])
def test_packing_refuses_what_it_would_coerce(call: Callable[[], Any], exc: type, field: str) -> None:
    with pytest.raises(exc, match=field):
        call()


def test_packing_still_takes_lists_and_empty_sequences() -> None:
    assert unpack(pack([1, -1], [[1, 2], []])) == ([1, None], [[1, 2], []])
    assert unpack(split_by_destination([3], [[4, 5]], [[1]])[1]) == ([3], [[4, 5]])


@pytest.mark.parametrize("tokens, exc", [
    ([1.5, 2.7], TypeError), (np.array([1.5, 2.5]), TypeError), ([-1, 2], ValueError), ((True, False), TypeError),
    (np.array([[1, 2], [3, 4]]), TypeError), (np.array([2**32 + 1]), ValueError), ([2**31], ValueError),
    ([[1, 2], [3]], TypeError), (["a", "b"], TypeError),
])
def test_group_key_takes_only_1d_token_ids_in_range(tokens: Any, exc: type) -> None:
    with pytest.raises(exc, match="group id token sequence"):
        group_key(tokens)
    assert group_key(np.array([1, 2], np.uint8)) == group_key([1, 2]) == group_key(np.array([1, 2], np.int64))


@pytest.mark.parametrize("call, exc, field", [
    (lambda r: r.preferences(np.array([2**40], np.int64), 1), ValueError, "group ids"),
    (lambda r: r.preferences(np.array([-1], np.int32), 1), ValueError, "group ids"),
    (lambda r: r.assign([1, 2], weights=[1.7, 2.9]), TypeError, "weights"),
    (lambda r: r.assign([1, 2], weights=[True, False]), TypeError, "weights"),
    (lambda r: r.assign([1, 2], weights=[float("nan"), 1]), TypeError, "weights"),
    (lambda r: r.assign([1, 2], weights=["a", "b"]), TypeError, "weights"),
    (lambda r: r.assign([1, 2, 3], weights=[2**62] * 3), ValueError, "weights"),
    (lambda r: r.assign([1, 2], base_load=[0.5] * 4), TypeError, "base_load"),
    (lambda r: r.assign([1, 2], base_load=[True] * 4), TypeError, "base_load"),
    (lambda r: r.set_available(0, "no"), TypeError, "available"),
    (lambda r: r.set_available(0, 0), TypeError, "available"),
    (lambda r: r.capacity(-100), ValueError, "total_load"),
    (lambda r: r.capacity(2.5), TypeError, "total_load"),
])
def test_router_refuses_what_it_would_coerce(call: Callable[[GroupRouter], Any], exc: type, field: str) -> None:
    router = GroupRouter(4)
    with pytest.raises(exc, match=field):
        call(router)
    assert not router._down.any()
    router.set_available(0, np.bool_(False))
    assert router._down.tolist() == [True, False, False, False]
    assert router.assign(np.array([1, 2], np.int32), weights=np.array([2, 3], np.uint8)).tolist() == \
        router.assign([1, 2], weights=[2, 3]).tolist()


def test_placement_and_config_store_plain_values() -> None:
    placement = ReplicaPlacement(np.int64(0), np.int64(2))
    assert json.dumps(placement.as_dict()) == '{"replica_id": 0, "num_replicas": 2}'
    config = SharedIndexConfig(np.int64(1), np.int64(2), affinity_k=np.int32(1), poll_interval_s=0)
    assert type(config.replica_id) is int and type(config.affinity_k) is int and type(config.poll_interval_s) is float
    for bad, exc in [(5, TypeError), ("", ValueError)]:
        with pytest.raises(exc, match="namespace"):
            SharedIndexConfig(0, 2, namespace=bad)
    with pytest.raises(TypeError, match="name"):
        SharedIndexConfig(0, 2, name=5)


@pytest.mark.parametrize("text", ["1_0", " 1", "1.0", "", "+1", "\u0661"])
def test_placement_from_env_takes_only_plain_decimal_digits(text: str) -> None:
    with pytest.raises(ValueError, match=ENV_REPLICA_ID):
        placement_from_env({ENV_REPLICA_ID: text, ENV_NUM_REPLICAS: "20"})
    assert placement_from_env({ENV_REPLICA_ID: "10", ENV_NUM_REPLICAS: "20"}) == ReplicaPlacement(10, 20)


def test_config_refuses_a_non_bool_apply_in_thread() -> None:
    with pytest.raises(TypeError, match="apply_in_thread must be a bool, got 1"):
        SharedIndexConfig(0, 2, apply_in_thread=1)


def test_record_keeps_nothing_of_a_groupless_response(monkeypatch: pytest.MonkeyPatch) -> None:
    client = _client(monkeypatch)
    client.record(None, [1, 2])
    assert client._recorded == ([], [])


def test_restart_refuses_while_a_stopped_puller_has_not_exited(monkeypatch: pytest.MonkeyPatch) -> None:
    client = _client(monkeypatch)
    leave = threading.Event()
    stuck = threading.Thread(target=leave.wait, daemon=True)
    stuck.start()
    client._thread = stuck
    client._stop.set()  # told to stop, but still in its round
    try:
        with pytest.raises(RuntimeError, match=r"the stopped shared-index puller did not exit within 0.0 s"):
            client.restart(timeout_s=0.0)
        assert client._thread is stuck
    finally:
        leave.set()
        stuck.join()


def test_a_pull_round_refuses_to_call_into_a_shut_down_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    ray = pytest.importorskip("ray")
    client = _client(monkeypatch)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="Ray was shut down while the shared index was open"):
        client._pull_round(0.0, 0)


def test_a_puller_whose_client_is_already_gone_ends_at_once() -> None:
    class Gone:
        pass

    ref = weakref.ref(Gone())  # collected at once: the client was dropped before its puller ran
    assert ref() is None
    shared_index._pull_until_stopped(ref, threading.Event())


class _Handle:
    """A stand-in actor handle: ``stats.remote()`` returns a ref that the patched ray.get reads."""

    def __init__(self) -> None:
        self.stats = self
        self.calls = 0

    def remote(self) -> "_Handle":
        self.calls += 1
        return self


def _scripted_get_actor(script: list[Any]) -> Callable[..., Any]:
    """ray.get_actor that raises ValueError (no such actor) for None entries, else returns them."""
    def get_actor(name: str, namespace: Any = None) -> Any:
        got = script.pop(0)
        if got is None:
            raise ValueError(f"Failed to look up actor {name!r}")
        return got
    return get_actor


class _NameTaken:
    """remote_cls whose creation fails as Ray's does while a dead actor's name is not released."""

    def options(self, **kwargs: Any) -> "_NameTaken":
        return self

    def remote(self, retain_steps: int) -> Any:
        raise ValueError("The name 'c.0' is already taken")


def test_a_dead_coordinators_name_is_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dead actor found by name, then a name not yet released: retried until a live one answers;
    a name never released is a RuntimeError naming the shard."""
    ray = pytest.importorskip("ray")
    from rollout_spec.distributed import coordinator

    dead, live = _Handle(), _Handle()
    monkeypatch.setattr(coordinator, "_all_alive", lambda handles: handles[0] is live)
    monkeypatch.setattr(ray, "get_actor", _scripted_get_actor([dead, None, live]))
    assert coordinator._live_or_new(_NameTaken(), "c.0", {"namespace": None}, 4, timeout_s=5.0) is live
    monkeypatch.setattr(ray, "get_actor", _scripted_get_actor([None]))
    with pytest.raises(RuntimeError, match=r"coordinator 'c.0' died and its name was not released within 0.0 s"):
        coordinator._live_or_new(_NameTaken(), "c.0", {"namespace": None}, 4, timeout_s=0.0)


def test_handles_are_looked_up_until_the_driver_has_created_them(monkeypatch: pytest.MonkeyPatch) -> None:
    ray = pytest.importorskip("ray")
    from rollout_spec.distributed.coordinator import coordinator_handles

    handle = _Handle()
    monkeypatch.setattr(ray, "get_actor", _scripted_get_actor([None, handle]))
    assert coordinator_handles("late", 1, timeout_s=5.0) == [handle]


def test_detached_coordinators_are_created_with_a_detached_lifetime(monkeypatch: pytest.MonkeyPatch) -> None:
    ray = pytest.importorskip("ray")
    from rollout_spec.distributed import coordinator

    made: list[dict] = []

    def live_or_new(remote_cls: Any, shard: str, options: dict, retain_steps: int) -> _Handle:
        made.append(dict(options, shard=shard))
        return _Handle()

    monkeypatch.setattr(coordinator, "_live_or_new", live_or_new)
    monkeypatch.setattr(ray, "get", lambda refs: refs)
    monkeypatch.setattr(ray, "get_actor", _scripted_get_actor([None, None]))  # none runs yet
    monkeypatch.setattr(coordinator, "_KEEP_ALIVE", {})
    handles = coordinator.create_coordinators("kept", num_shards=2, namespace="ns", detached=True)
    assert [h.calls for h in handles] == [1, 1]
    assert made == [{"namespace": "ns", "lifetime": "detached", "shard": coordinator._shard_name("kept", s)}
                    for s in range(2)]


def test_a_step_beyond_int64_is_refused_before_anything_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps travel as int64 (a pull's own_steps): a larger one was kept, and the pull from the
    start after a coordinator reset then raised in the coordinator and stopped the puller."""
    coord = IndexCoordinator(2)
    before = _snapshot(coord)
    with pytest.raises(ValueError, match=r"step must be in \[0, 9223372036854775807\]"):
        coord.publish(0, 2**63, [1], [len(BUCKET)], BUCKET)
    assert _snapshot(coord) == before
    assert coord.publish(0, 2**63 - 1, [1], [len(BUCKET)], BUCKET) == 1
    client = _client(monkeypatch)
    client.record(1, [1, 2])
    with pytest.raises(ValueError, match="step must be in"):
        client.publish(2**63)
    assert client._recorded[0] == [1] and client._published_steps == set() and client._backlog == {}


def test_the_client_checks_its_config_and_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shared_index, "coordinator_handles", lambda *a: [None])
    monkeypatch.setattr(shared_index, "coordinators_retain_steps", lambda *a: 4)
    with pytest.raises(TypeError, match="config must be a SharedIndexConfig, got dict"):
        SharedIndexClient(_Sink(), {"replica_id": 0, "num_replicas": 2}, start=False)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="start must be a bool, got str 'no'"):
        SharedIndexClient(_Sink(), SharedIndexConfig(0, 2), start="no")  # type: ignore[arg-type]


def test_a_config_refuses_shards_that_would_serve_no_replica() -> None:
    with pytest.raises(ValueError, match=r"num_shards must be in \[1, 2\], got 3"):
        SharedIndexConfig(0, 2, num_shards=3)
    assert SharedIndexConfig(0, 2, num_shards=2).num_shards == 2


@pytest.mark.parametrize("sequences", [(s for s in [[1]]), {0: [1]}, None], ids=["generator", "dict", "none"])
def test_packing_names_sequences_that_are_not_a_sequence(sequences: Any) -> None:
    with pytest.raises(TypeError, match="sequences must be a sequence of 1-D token id arrays"):
        pack([1], sequences)
    with pytest.raises(TypeError, match="sequences must be a sequence of 1-D token id arrays"):
        split_by_destination([1], sequences, [[0]])


@pytest.mark.parametrize("call, exc, field", [
    (lambda: rendezvous_scores(np.array([1.7]), 2), TypeError, "keys"),  # was truncated to 1
    (lambda: rendezvous_scores(np.array([[1]]), 2), TypeError, "keys"),  # was a 3-D answer
    (lambda: rendezvous_scores(np.array([1]), 0), ValueError, "num_replicas"),  # was no replica
    (lambda: rendezvous_scores(np.array([1]), 2.5), TypeError, "num_replicas"),  # was 3 replicas
    (lambda: rendezvous_scores(np.array([1]), 2, 1.5), TypeError, "seed"),  # was seed 1
    (lambda: rendezvous_scores(np.array([1]), 2, -1), ValueError, "seed"),  # was an OverflowError
    (lambda: mix64(np.array([1.5])), TypeError, "integers"),
])
def test_rendezvous_scores_refuse_what_they_would_truncate(call: Callable[[], Any], exc: type, field: str) -> None:
    with pytest.raises(exc, match=field):
        call()
    assert np.array_equal(rendezvous_scores([3, 4], 2, 1), rendezvous_scores(np.array([3, 4], np.uint8), 2, 1))


def test_placement_names_an_environ_that_is_not_a_mapping() -> None:
    with pytest.raises(TypeError, match="environ must be a mapping or None, got list"):
        placement_from_env([(ENV_REPLICA_ID, "0")])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="environ must be a mutable mapping or None, got list"):
        ReplicaPlacement(0, 2).to_env([])  # type: ignore[arg-type]


def test_share_drafter_and_ensure_coordinators_check_their_arguments() -> None:
    from rollout_spec.config import SpecConfig
    from rollout_spec.distributed.sharing import ensure_coordinators, share_drafter

    with pytest.raises(TypeError, match=r"placement must be a ReplicaPlacement or None, got tuple \(0, 2\)"):
        share_drafter(_Sink(), SpecConfig(shared_index="x"), (0, 2))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="spec must be a SpecConfig, got NoneType"):
        share_drafter(_Sink(), None, None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_replicas must be in"):
        ensure_coordinators(SpecConfig(), -5)  # a hook's bad count shows without shared_index too
    with pytest.raises(TypeError, match="spec must be a SpecConfig"):
        ensure_coordinators(None, 2)  # type: ignore[arg-type]


class _Coordinator(_Handle):
    """A stand-in handle that also tells its ``retain_steps`` (the patched ray.get returns it)."""

    def __init__(self, retain_steps: int) -> None:
        super().__init__()
        self.get_retain_steps = SimpleNamespace(remote=lambda: retain_steps)


@pytest.fixture
def fake_ray(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Ray calls answered in-process: ``get`` returns what ``.remote()`` returned, no actor runs
    under any name, ``_live_or_new`` makes a fresh stand-in with the asked ``retain_steps``."""
    ray = pytest.importorskip("ray")
    from rollout_spec.distributed import coordinator

    monkeypatch.setattr(ray, "get", lambda refs, timeout=None: refs)
    monkeypatch.setattr(ray, "get_actor", lambda name, namespace=None: (_ for _ in ()).throw(ValueError(name)))
    monkeypatch.setattr(coordinator, "_live_or_new", lambda cls, shard, options, retain: _Coordinator(retain))
    monkeypatch.setattr(coordinator, "_KEEP_ALIVE", {})
    return ray


@pytest.mark.parametrize("kwargs, exc, field", [
    ({"name": None}, TypeError, "name must be a non-empty str, got NoneType"),  # was actors 'None-0'
    ({"name": ""}, ValueError, "name must be a non-empty str, got ''"),
    ({"namespace": ""}, ValueError, "namespace must be a non-empty str or None"),  # waited 60 s, then raised
    ({"namespace": 5}, TypeError, "namespace must be"),
    ({"detached": "no"}, TypeError, "detached must be a bool, got str 'no'"),  # was detached
])
def test_create_coordinators_checks_names_and_detached(fake_ray: Any, kwargs: dict, exc: type, field: str) -> None:
    from rollout_spec.distributed import coordinator

    with pytest.raises(exc, match=field):
        coordinator.create_coordinators(**{"name": "job", **kwargs})
    assert coordinator._KEEP_ALIVE == {}


def test_create_coordinators_refuses_another_shape_of_running_ones(fake_ray: Any, monkeypatch) -> None:
    """Another num_shards dropped the running handles mid-call (Ray killed those actors: an
    ActorDiedError); another retain_steps returned actors that keep a different window."""
    from rollout_spec.distributed import coordinator

    kept = coordinator.create_coordinators("job", num_shards=1, retain_steps=4)
    with pytest.raises(ValueError, match=r"coordinators 'job' run with num_shards=1, not 2"):
        coordinator.create_coordinators("job", num_shards=2, retain_steps=4)
    with pytest.raises(ValueError, match=r"coordinators 'job' run with retain_steps=4, not 2"):
        coordinator.create_coordinators("job", num_shards=1, retain_steps=2)
    assert coordinator._KEEP_ALIVE == {(None, "job"): kept}
    assert coordinator.create_coordinators("job", num_shards=1, retain_steps=4) is kept
    # made by another process (or detached, by an earlier job): found by name before any is created
    other = _Coordinator(3)
    monkeypatch.setattr(fake_ray, "get_actor", lambda name, namespace=None: other)
    with pytest.raises(ValueError, match=r"coordinators 'other' run with retain_steps=3, not 4"):
        coordinator.create_coordinators("other", num_shards=1, retain_steps=4)
    assert (None, "other") not in coordinator._KEEP_ALIVE


@pytest.mark.parametrize("call, exc, field", [
    (lambda c: c.coordinator_handles(None, 1), TypeError, "name must be"),  # found 'None-0'
    (lambda c: c.coordinator_handles("job", 0), ValueError, "num_shards must be in"),  # was []
    (lambda c: c.coordinator_handles("job", 1.5), TypeError, "num_shards must be an integer"),
    # NaN: a missing shard was waited for forever
    (lambda c: c.coordinator_handles("job", 1, timeout_s=float("nan")), ValueError, "timeout_s"),
    (lambda c: c.coordinators_retain_steps([]), ValueError, "handles must hold at least one"),  # was an IndexError
    (lambda c: c.coordinators_retain_steps([_Coordinator(2)], timeout_s=-1), ValueError, "timeout_s"),
    (lambda c: c.destroy_coordinators(None, 1), TypeError, "name must be"),  # did nothing
])
def test_the_coordinator_lookups_check_their_arguments(fake_ray: Any, monkeypatch, call, exc, field) -> None:
    from rollout_spec.distributed import coordinator

    monkeypatch.setattr(fake_ray, "get_actor", lambda name, namespace=None: _Coordinator(2))
    with pytest.raises(exc, match=field):
        call(coordinator)

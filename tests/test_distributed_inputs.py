"""Bad input to the distributed package's public functions is refused, naming the field, before any
state changes; nothing is truncated, wrapped or taken as a bool (no Ray needed)."""
from __future__ import annotations

import json
from typing import Any, Callable

import numpy as np
import pytest

import rollout_spec.distributed.shared_index as shared_index
from rollout_spec.distributed import GroupRouter, group_key
from rollout_spec.distributed.coordinator import IndexCoordinator
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

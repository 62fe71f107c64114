"""The shared index on a local Ray cluster: replica actors in separate worker processes, the real
NgramDrafter in each, publications through the coordinator actor."""
from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="the shared index needs Ray: pip install 'rollout-spec[ray]'")

from rollout_spec.config import SpecConfig  # noqa: E402
from rollout_spec.distributed import (  # noqa: E402
    GroupRouter,
    SharedIndexClient,
    SharedIndexConfig,
    SharingDrafter,
    coordinator_handles,
    create_coordinators,
    destroy_coordinators,
)
from rollout_spec.drafter import NgramDrafter  # noqa: E402
from polling import wait_until  # noqa: E402

PROMPT = [1, 2, 3, 4]


@pytest.fixture(scope="module")
def ray_cluster():
    """A local cluster; worker processes import this module, so they get tests/ on their path."""
    here = str(Path(__file__).parent)
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
    if ray.is_initialized():  # another module's cluster lacks our runtime_env
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    yield
    ray.shutdown()


@ray.remote(num_cpus=0)
class Replica:
    """A rollout replica reduced to what the index sees: its drafter and its shared-index client."""

    def __init__(self, replica_id: int, num_replicas: int, name: str, affinity_k: int, in_thread: bool) -> None:
        self.drafter = NgramDrafter(SpecConfig(num_draft_tokens=8, history_steps=4))
        cfg = SharedIndexConfig(replica_id=replica_id, num_replicas=num_replicas, affinity_k=affinity_k,
                                name=name, poll_interval_s=0.02, apply_in_thread=in_thread)
        self.client = SharedIndexClient(self.drafter, cfg)
        self.next_req = 0

    def generate(self, group_id: int, responses: list[list[int]]) -> None:
        """Stand-in for a rollout: the drafter sees the samples as the engine would feed them."""
        for resp in responses:
            req = self._req()
            self.drafter.start(req, PROMPT, group_id)
            self.drafter.extend(req, resp)
            self.drafter.finish(req)
            self.client.record(group_id, resp)

    def end_step(self, step: int) -> dict:
        cost = self.client.publish(step)
        self.client.flush()
        self.drafter.end_step()
        return cost

    def wait_applied(self, count: int, timeout_s: float = 30.0) -> dict:
        """Apply staged responses between 'decode steps' until ``count`` were ingested."""
        return wait_until(self._apply_and_read, f"fewer than {count} sequences were ingested",
                          until=lambda stats: stats["sequences_applied"] >= count, timeout_s=timeout_s)

    def _apply_and_read(self) -> dict:
        """One 'decode step': apply what is staged, then read the client's stats."""
        self.client.apply()
        return self.client.stats()

    def apply_staged(self, max_sequences: int, timeout_s: float = 30.0) -> int:
        """Wait until at least ``max_sequences`` are staged, then apply that many."""
        wait_until(lambda: self.client.stats()["staged_sequences"], f"fewer than {max_sequences} sequences were staged",
                   until=lambda staged: staged >= max_sequences, timeout_s=timeout_s)
        return self.client.apply(max_sequences)

    def propose(self, group_id: int, context: list[int]) -> list[int]:
        req = self._req()
        self.drafter.start(req, PROMPT, group_id)
        self.drafter.extend(req, context)
        draft = self.drafter.propose([req])
        self.drafter.finish(req)
        return draft.tokens[draft.parents == np.arange(-1, len(draft.parents) - 1)].tolist()  # main chain

    def end_drafter_step(self) -> None:
        self.drafter.end_step()

    def stats(self) -> dict:
        return {**self.client.stats(), "step_at_join": self.client.step_at_join}

    def _req(self) -> int:
        self.next_req += 1
        return self.next_req


def _assert_continues(draft: list[int], truth: list[int]) -> None:
    """The draft is a real continuation: these token ids exist nowhere but in that response."""
    assert len(draft) >= 3 and draft == truth[: len(draft)], (draft, truth[:8])


def _coordinator() -> str:
    """A fresh coordinator, created by the driver as a real job's trainer would."""
    name = f"idx-{uuid.uuid4().hex[:8]}"
    create_coordinators(name, num_shards=1, retain_steps=4)
    return name


def _group_preferring(prefs: list[int], num_replicas: int) -> int:
    """A group id whose router ranking starts with ``prefs``."""
    router = GroupRouter(num_replicas)
    for gid in range(10_000):
        if router.preferences([gid], len(prefs))[0].tolist() == prefs:
            return gid
    raise AssertionError(f"no group prefers {prefs}")


def _responses(seed: int, count: int = 4, length: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(seed)  # distinct token ids: a proposal can only come from these
    return [rng.choice(np.arange(1000, 30000), size=length, replace=False).tolist() for _ in range(count)]


@pytest.mark.parametrize("in_thread", [False, True], ids=["owner-applies", "thread-applies"])
def test_siblings_from_another_replica_are_proposed_after_a_step(ray_cluster, in_thread: bool) -> None:
    name = _coordinator()
    reps = [Replica.remote(i, 3, name, 1, in_thread) for i in range(3)]
    gid = _group_preferring([1], 3)  # the router sends this group to replica 1 ...
    responses = _responses(seed=7)
    ray.get(reps[0].generate.remote(gid, responses))  # ... but a non-sticky framework ran it on 0
    assert ray.get(reps[1].propose.remote(gid, responses[2][:6])) == []  # before the step: nothing
    cost = ray.get(reps[0].end_step.remote(0))
    assert cost["tokens"] == 4 * 40 and cost["buckets"] == 1
    stats = ray.get(reps[1].wait_applied.remote(4))
    assert stats["fetched_tokens"] == 160
    _assert_continues(ray.get(reps[1].propose.remote(gid, responses[2][:6])), responses[2][6:])
    ray.get(reps[1].end_drafter_step.remote())  # next RL step: the siblings are now group history
    _assert_continues(ray.get(reps[1].propose.remote(gid, responses[3][10:16])), responses[3][16:])
    # replica 2 is not among the group's affinity_k=1 choices: it fetched nothing
    assert ray.get(reps[2].stats.remote())["fetched_tokens"] == 0
    assert ray.get(reps[2].propose.remote(gid, responses[2][:6])) == []
    for r in reps:
        ray.kill(r)
    destroy_coordinators(name, 1)


def test_killed_replica_recovers_its_and_others_publications(ray_cluster) -> None:
    name = _coordinator()
    reps = [Replica.remote(i, 3, name, 2, False) for i in range(3)]
    own = _group_preferring([1, 2], 3)  # replica 1 serves it, replica 2 keeps a copy
    other = _group_preferring([2, 1], 3)
    own_resp, other_resp = _responses(seed=1), _responses(seed=2)
    ray.get(reps[1].generate.remote(own, own_resp))
    ray.get(reps[2].generate.remote(other, other_resp))
    ray.get([reps[1].end_step.remote(0), reps[2].end_step.remote(0)])
    ray.get(reps[1].wait_applied.remote(4))  # the copy of `other` reached replica 1 before it died
    ray.kill(reps[1])  # its process, drafter and in-memory index are gone
    reborn = Replica.remote(1, 3, name, 2, False)
    assert ray.get(reborn.propose.remote(own, own_resp[0][:6])) == []  # fresh drafter
    assert ray.get(reborn.apply_staged.remote(1)) == 1  # the owner applies in small installments
    stats = ray.get(reborn.wait_applied.remote(8))  # catch-up: its own last step + the copy of `other`
    assert stats["fetched_tokens"] == 8 * 40
    assert ray.get(reborn.stats.remote())["step_at_join"] == 0  # step 0 was the newest at its first pull
    _assert_continues(ray.get(reborn.propose.remote(own, own_resp[1][:6])), own_resp[1][6:])
    _assert_continues(ray.get(reborn.propose.remote(other, other_resp[3][:6])), other_resp[3][6:])
    # after catching up it ingests only others' new publications, not its own again
    ray.get(reborn.generate.remote(own, _responses(seed=3)))
    ray.get(reborn.end_step.remote(1))
    time.sleep(0.2)
    assert ray.get(reborn.stats.remote())["fetched_tokens"] == 8 * 40
    for r in (reps[0], reps[2], reborn):
        ray.kill(r)
    destroy_coordinators(name, 1)


def test_config_and_client_validate_inputs() -> None:
    with pytest.raises(ValueError, match="replica_id"):
        SharedIndexConfig(replica_id=3, num_replicas=3)
    with pytest.raises(ValueError, match="affinity_k"):
        SharedIndexConfig(replica_id=0, num_replicas=2, affinity_k=0)
    with pytest.raises(TypeError, match="add_sequences"):
        SharedIndexClient(object(), SharedIndexConfig(replica_id=0, num_replicas=1), start=False)


def test_missing_coordinator_is_a_clear_error(ray_cluster) -> None:
    cfg = SharedIndexConfig(replica_id=0, num_replicas=1, name="never-created", lookup_timeout_s=0.0)
    with pytest.raises(LookupError, match="create_coordinators"):
        SharedIndexClient(NgramDrafter(), cfg, start=False)


def test_creating_again_replaces_a_coordinator_that_died(ray_cluster) -> None:
    """The driver's second create_coordinators call (a hook of another replica object) after a
    coordinator was killed makes a new one that replicas find, not the dead handle again."""
    from rollout_spec.distributed.coordinator import coordinator_handles

    name = f"revive-{uuid.uuid4().hex[:8]}"
    (first,) = create_coordinators(name, 1, 2)
    assert create_coordinators(name, 1, 2) == [first]  # alive: the same actor
    ray.kill(first)  # asynchronous: wait until the actor no longer answers
    wait_until(lambda: not _answers(first), "the killed coordinator still answers", timeout_s=60.0)
    (second,) = create_coordinators(name, 1, 2)
    assert ray.get(second.stats.remote())["latest_step"] == -1
    assert ray.get(coordinator_handles(name, 1, timeout_s=10.0)[0].stats.remote())["entries"] == 0
    destroy_coordinators(name, 1)


def test_creating_again_with_another_shape_leaves_the_running_coordinators(ray_cluster) -> None:
    """Another num_shards rebuilt the list and dropped the running handles mid-call: Ray killed
    those actors (their publications lost) and the call raised an ActorDiedError."""
    name = f"shape-{uuid.uuid4().hex[:8]}"
    (first,) = create_coordinators(name, 1, 2)
    with pytest.raises(ValueError, match="run with num_shards=1, not 2"):
        create_coordinators(name, 2, 2)
    with pytest.raises(ValueError, match="run with retain_steps=2, not 3"):
        create_coordinators(name, 1, 3)
    assert create_coordinators(name, 1, 2) == [first] and _answers(first)
    destroy_coordinators(name, 1)


def test_destroy_kills_the_shards_left_when_one_died(ray_cluster) -> None:
    """One shard of a job died (its name is free again): destroying the job's coordinators still
    kills the others, instead of raising that they were never created and leaving them running."""
    name = f"partial-{uuid.uuid4().hex[:8]}"
    first, second = create_coordinators(name, 2, 2)
    ray.kill(second)
    deadline = time.monotonic() + 60  # one limit for both waits below
    wait_until(lambda: _name_is_free(f"{name}-1"), "the killed shard's name was not released",  # asynchronously
               timeout_s=deadline - time.monotonic())
    destroy_coordinators(name, 2)
    wait_until(lambda: not _answers(first), "the live shard was not killed", timeout_s=deadline - time.monotonic())
    destroy_coordinators(name, 2)  # nothing left: nothing to do
    with pytest.raises(ValueError, match="num_shards"):
        destroy_coordinators(name, 0)


def _name_is_free(actor_name: str) -> bool:
    """Whether no live actor holds ``actor_name`` (in this job's namespace)."""
    try:
        ray.get_actor(actor_name)
    except ValueError:
        return True
    return False


def _answers(handle) -> bool:
    """Whether the actor still answers (a slow reply counts as an answer: asked again)."""
    try:
        ray.get(handle.stats.remote(), timeout=10)
    except ray.exceptions.RayActorError:
        return False
    except ray.exceptions.GetTimeoutError:
        return True
    return True


class _Sink:
    """Collects what a client ingests (a drafter's add_sequences, minus the index)."""

    def __init__(self) -> None:
        self.got: list[tuple[int | None, list[int]]] = []

    def add_sequences(self, group_ids: list, sequences: list) -> None:
        self.got += list(zip(group_ids, sequences))


def test_ingest_budget_keeps_the_newest_steps_and_bad_tokens_are_refused(ray_cluster) -> None:
    name = _coordinator()
    gid = _group_preferring([1], 2)
    cfg = dict(num_replicas=2, affinity_k=1, name=name, lookup_timeout_s=5.0)
    writer = SharedIndexClient(_Sink(), SharedIndexConfig(replica_id=0, **cfg), start=False)
    for step in range(3):  # three steps of 30 tokens each for replica 1
        writer.record(gid, list(range(100 * step, 100 * step + 30)))
        writer.publish(step)
    writer.flush()
    sink = _Sink()
    reader = SharedIndexClient(sink, SharedIndexConfig(replica_id=1, ingest_budget_tokens=70, **cfg), start=False)
    assert reader.poll() == 2 and reader.apply() == 2
    assert [seq[0] for _, seq in sink.got] == [100, 200]  # the two newest steps fit the budget
    assert reader.stats()["entries_over_budget"] == 1
    with pytest.raises(ValueError, match="token_ids"):
        writer.record(gid, [5, -1])
    with pytest.raises(ValueError, match="group_id"):
        writer.record(2**31, [5])
    destroy_coordinators(name, 1)


def _puller_failed(client: SharedIndexClient) -> bool:
    """Whether the client's puller thread stopped on an error (its stats() still answer)."""
    return client.stats()["puller_failed"] == 1.0


def _sharing(name: str, replica_id: int, drafter: NgramDrafter) -> SharingDrafter:
    cfg = SharedIndexConfig(replica_id=replica_id, num_replicas=2, name=name, poll_interval_s=0.01,
                            max_poll_interval_s=0.02, lookup_timeout_s=5.0)
    return SharingDrafter(drafter, SharedIndexClient(drafter, cfg))


def test_a_failed_puller_is_raised_at_every_boundary_and_the_drafter_still_ages(ray_cluster, caplog) -> None:
    """The coordinator dies: the puller retries ``max_pull_errors`` times, then logs that it
    stopped, each step boundary raises its error, and the wrapped drafter still ends its step each
    time (stuck, it would keep group history past ``history_steps``). Once the driver replaces the
    coordinator, ``restart()`` makes the replica share again."""
    name = f"dead-{uuid.uuid4().hex[:8]}"
    (coord,) = create_coordinators(name, 1, 4)
    drafter = NgramDrafter(SpecConfig(history_steps=1))
    shared = _sharing(name, 0, drafter)
    shared.end_step()
    ray.kill(coord)
    wait_until(lambda: _puller_failed(shared.index), "the puller did not notice the dead coordinator", timeout_s=60.0)
    assert any(r.levelname == "ERROR" and "puller of replica 0 stopped" in r.getMessage() for r in caplog.records)
    for step in (2, 3):
        with pytest.raises(RuntimeError, match="puller thread failed") as err:
            shared.end_step()
        assert isinstance(err.value.__cause__, ray.exceptions.RayActorError)
        assert drafter.stats()["step"] == step
    with pytest.raises(RuntimeError, match="puller thread failed"):
        shared.close()
    create_coordinators(name, 1, 4)  # the driver replaces the dead coordinator under its name
    shared.index.restart()
    assert shared.index.stats()["pull_errors"] == shared.index.config.max_pull_errors
    shared.start(1, PROMPT, group_id=3)
    shared.extend(1, [7, 8, 9])
    shared.finish(1)
    shared.end_step()
    shared.index.flush()
    (fresh,) = coordinator_handles(name, 1)
    assert ray.get(fresh.stats.remote())["publishes"] == 1
    shared.close()
    destroy_coordinators(name, 1)


def test_a_replica_joining_mid_job_numbers_its_first_step_from_the_job(ray_cluster) -> None:
    """Its first boundary comes before its puller's first pull returned: the step is still the
    job's (6 here, after steps 0-5), not 0, which the coordinator would evict a step later."""
    name = _coordinator()
    peer = SharedIndexClient(_Sink(), SharedIndexConfig(replica_id=1, num_replicas=2, name=name), start=False)
    for step in range(6):
        peer.record(3, [100 + step, 1, 2])
        peer.publish(step)
    peer.flush()
    drafter = NgramDrafter()
    shared = _sharing(name, 0, drafter)  # its puller's first pull is in flight ...
    shared.start(1, PROMPT, group_id=3)
    shared.extend(1, [7, 8, 9])
    shared.finish(1)
    shared.end_step()  # ... while the replica reaches a boundary at once
    shared.index.flush()
    (coord,) = coordinator_handles(name, 1)
    got = ray.get(coord.pull.remote(1, -1))
    assert [(e.src, e.step) for e in got.entries] == [(0, 6)]
    shared.close()
    destroy_coordinators(name, 1)

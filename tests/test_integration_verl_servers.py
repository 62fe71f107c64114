"""Our verl server subclasses over stand-ins for verl's SGLang/vLLM server classes.

verl's server modules import SGLang's and vLLM's CUDA kernels, so they cannot be imported on a
CPU machine; the stand-ins reproduce only what the subclasses rely on (``config``, the engine
object set by ``launch_server``, ``generate`` returning a TokenOutput with ``extra_fields``),
which ``test_verl_still_has_the_shape_the_hook_relies_on`` checks in verl's real source. verl's
server managers, whose module cannot be imported either, are compiled from its source alone and
run over our replicas on those stand-ins, with verl's real router module.
"""
from __future__ import annotations

import ast
import asyncio
import importlib
import importlib.util
import logging
import os
import sys
import threading
import time
import types
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest

from rollout_spec.distributed.placement import ENV_NUM_REPLICAS, ENV_REPLICA_ID
from rollout_spec.groups import prompt_group_id
from rollout_spec.integrations.sglang.config import ENV_VAR, spec_from_env
from rollout_spec.integrations.sglang.rid import group_from_rid

ray = pytest.importorskip("ray", reason="verl's replicas wrap servers with ray.remote")

FLAG = {"speculative": "rollout_spec", "rollout_spec": {"num_draft_tokens": 5}}


def config(custom):
    return SimpleNamespace(name="sglang", custom=custom, engine_kwargs={"sglang": {"attention_backend": "fa3"}},
                           mtp=None, disaggregation=None, tensor_model_parallel_size=1, data_parallel_size=1)


class _TokenizerManager:
    async def generate_request(self, obj, request=None):
        yield {"output_ids": [7, 8, 9], "meta_info": {"spec_verify_ct": 2, "spec_num_proposed_drafts": 10,
                                                      "spec_num_correct_drafts": 1, "completion_tokens": 3}}


class SGLangHttpServer:
    """Stand-in for verl's: the parts our subclass relies on."""

    def __init__(self, config, *args, replica_rank=0, **kwargs):
        self.config = config
        self.replica_rank = replica_rank

    async def launch_server(self, *args, **kwargs):
        self.launched_with = dict(self.config.engine_kwargs["sglang"])
        self.tokenizer_manager = _TokenizerManager()

    async def generate(self, prompt_ids, sampling_params, request_id, *args, **kwargs):
        obj = SimpleNamespace(rid=request_id)
        out = await self.tokenizer_manager.generate_request(obj, None).__anext__()
        return SimpleNamespace(token_ids=out["output_ids"], extra_fields={"global_steps": 0}, rid=request_id)


class SGLangReplica:
    def __init__(self, replica_rank, config, *args, is_reward_model=False, is_teacher_model=False, **kwargs):
        self.replica_rank, self.config, self.world_size = replica_rank, config, 1
        self.is_reward_model, self.is_teacher_model = is_reward_model, is_teacher_model
        self.server_class = "verl's own"

    async def init_hybrid(self, worker_group):
        self._started(f"10.0.0.{self.replica_rank}:8000")

    async def init_colocated(self, resource_pool):
        self._started(f"10.0.1.{self.replica_rank}:8000")

    async def init_standalone(self):
        self._started(f"10.0.2.{self.replica_rank}:8000")

    def _started(self, address):
        self._server_address, self._server_handle = address, f"actor at {address}"


@pytest.fixture(autouse=True)
def fresh_router_hook_state(monkeypatch):
    """Each test starts with no replica of ours and no balanced server: the hook's state is
    process-wide, and the stand-ins' addresses repeat from test to test."""
    from rollout_spec.integrations.verl import replicas as hook

    monkeypatch.setattr(hook, "_SPEC_REPLICAS", weakref.WeakSet())
    monkeypatch.setattr(hook, "_BALANCED", set())


@pytest.fixture
def sglang_server(monkeypatch):
    fake = types.ModuleType("verl.workers.rollout.sglang_rollout.async_sglang_server")
    fake.SGLangHttpServer, fake.SGLangReplica = SGLangHttpServer, SGLangReplica
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    for var in (ENV_VAR, ENV_REPLICA_ID, ENV_NUM_REPLICAS):  # what a launch writes is undone after
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    sys.modules.pop("rollout_spec.integrations.verl.sglang_server", None)
    yield importlib.import_module("rollout_spec.integrations.verl.sglang_server")
    sys.modules.pop("rollout_spec.integrations.verl.sglang_server", None)


def test_flag_off_is_verls_server_unchanged(sglang_server):
    server = sglang_server.RolloutSpecSGLangHttpServer(config(None))
    asyncio.run(server.launch_server())
    out = asyncio.run(server.generate([1, 2], {}, "req-1"))
    assert out.rid == "req-1" and out.extra_fields == {"global_steps": 0}
    assert server.launched_with == {"attention_backend": "fa3"} and ENV_VAR not in os.environ
    assert sglang_server.RolloutSpecSGLangReplica(0, config(None)).server_class == "verl's own"


def test_flag_on_launches_ngram_tags_groups_and_reports_counters(sglang_server):
    server = sglang_server.RolloutSpecSGLangHttpServer(config(FLAG))
    asyncio.run(server.launch_server())
    assert server.launched_with["speculative_algorithm"] == "NGRAM"
    assert server.launched_with["speculative_num_draft_tokens"] == 6
    assert server.launched_with["attention_backend"] == "fa3"
    assert spec_from_env().num_draft_tokens == 5
    a = asyncio.run(server.generate([1, 2, 3], {}, "req-a"))
    b = asyncio.run(server.generate([1, 2, 3], {}, "req-b"))
    assert a.rid.startswith("req-a|rsg=") and group_from_rid(a.rid) == group_from_rid(b.rid)
    assert a.extra_fields == {"global_steps": 0, "spec_num_draft_tokens": 10,
                              "spec_num_accepted_tokens": 1, "spec_num_verify_steps": 2}
    assert server._spec_meta == {}, "per-request counters are dropped once returned"
    replica = sglang_server.RolloutSpecSGLangReplica(0, config(FLAG))
    assert replica.server_class.__class__.__name__ == "ActorClass(RolloutSpecSGLangHttpServer)"


def test_sglang_later_turns_and_resumed_tails_carry_the_first_prompts_group(sglang_server):
    """verl sends a sample's next turn (prompt + output + tool output) or its resumed tail under a
    fresh request id to the server of its first call: the rid's group is the first prompt's."""
    server = sglang_server.RolloutSpecSGLangHttpServer(config(FLAG))
    asyncio.run(server.launch_server())
    first = asyncio.run(server.generate([1, 2, 3], {}, "uuid-1"))
    turn2 = asyncio.run(server.generate([1, 2, 3, 7, 8, 9, 40, 41], {}, "uuid-2"))
    turn3 = asyncio.run(server.generate([1, 2, 3, 7, 8, 9, 40, 41, 7, 8, 9, 42], {}, "uuid-3"))
    other = asyncio.run(server.generate([1, 2, 4], {}, "uuid-4"))
    assert group_from_rid(first.rid) == prompt_group_id([1, 2, 3]), "a first call keeps its own group"
    assert group_from_rid(turn2.rid) == group_from_rid(turn3.rid) == group_from_rid(first.rid)
    assert turn3.rid.startswith("uuid-3|rsg=") and group_from_rid(other.rid) == prompt_group_id([1, 2, 4])


def test_bad_flag_fails_when_the_replica_is_built(sglang_server):
    with pytest.raises(ValueError, match="num_draft_tokens must be in"):
        sglang_server.RolloutSpecSGLangReplica(0, config({"speculative": "rollout_spec",
                                                          "rollout_spec": {"num_draft_tokens": 5000}}))


def test_shared_index_reaches_the_server_and_our_servers_route_group_sticky(sglang_server, monkeypatch):
    from rollout_spec.distributed import sharing
    from rollout_spec.distributed.placement import placement_from_env

    made = []
    monkeypatch.setattr(sharing, "ensure_coordinators", lambda spec, n: made.append((spec.shared_index, n)))
    router = types.ModuleType("verl.workers.rollout.router")
    router.get_router_handle = lambda servers, router_config_path=None, full_determinism=False, \
        load_balancer_cls=None: ("verl's", router_config_path)
    monkeypatch.setitem(sys.modules, router.__name__, router)
    flag = {"speculative": "rollout_spec", "rollout_spec": {"shared_index": "job-7"}}
    replicas = [sglang_server.RolloutSpecSGLangReplica(r, config(dict(flag, rollout_spec=dict(flag["rollout_spec"]))))
                for r in range(3)]
    for replica in replicas:  # verl's hybrid start: 6 workers, 2 per replica (tp=2 would be refused below)
        replica.world_size = 2
        asyncio.run(replica.init_hybrid(SimpleNamespace(world_size=6)))
    assert made == [("job-7", 3)] * 3 and replicas[2].config.custom["rollout_spec_num_replicas"] == 3
    server = sglang_server.RolloutSpecSGLangHttpServer(replicas[2].config, replica_rank=2)
    server.config.tensor_model_parallel_size = 1
    asyncio.run(server.launch_server())
    assert placement_from_env().as_dict() == {"replica_id": 2, "num_replicas": 3}  # for SGLang's schedulers
    server.config.tensor_model_parallel_size = 2
    with pytest.raises(ValueError, match="tensor_model_parallel_size=1"):
        asyncio.run(server.launch_server())
    ours = {r._server_address: f"h{i}" for i, r in enumerate(replicas)}
    monkeypatch.setattr(ray, "remote", lambda cls: SimpleNamespace(remote=lambda *args: cls(*args)))  # no cluster
    lb = router.get_router_handle(ours)  # verl's default choice, replaced by ours
    assert type(lb).__name__ == "GroupStickyLoadBalancer" and lb.get_all_servers() == list(ours)
    assert router.get_router_handle(ours, router_config_path="mine.yaml") == ("verl's", "mine.yaml")
    assert router.get_router_handle({"reward:1": "h"}) == ("verl's", None)  # not our replicas' servers
    assert router.get_router_handle(ours, full_determinism=True) == ("verl's", None)  # routes by request id
    unplaced = sglang_server.RolloutSpecSGLangHttpServer(config(flag), replica_rank=0)
    with pytest.raises(ValueError, match="replica count is missing"):
        asyncio.run(unplaced.launch_server())


def test_a_rank_beyond_the_replica_count_is_refused_with_shared_index(sglang_server, monkeypatch):
    """verl's separate-async trainer ranks its standalone replicas after the hybrid ones: rank 3
    of 3 cannot join one shared index, and says why (not ReplicaPlacement's bare range error)."""
    from rollout_spec.distributed import sharing

    monkeypatch.setattr(sharing, "ensure_coordinators", lambda spec, n: pytest.fail("created"))
    router = types.ModuleType("verl.workers.rollout.router")
    router.get_router_handle = lambda servers, router_config_path=None, full_determinism=False, \
        load_balancer_cls=None: None
    monkeypatch.setitem(sys.modules, router.__name__, router)
    flag = {"speculative": "rollout_spec", "rollout_spec": {"shared_index": "job-8"}}
    replica = sglang_server.RolloutSpecSGLangReplica(3, config(flag))
    with pytest.raises(ValueError, match=r"shared_index needs replica ranks in \[0, 2\] \(3 replicas from the "
                                         r"worker group's size over 1 GPUs per replica\), got 3: verl's separate"):
        asyncio.run(replica.init_hybrid(SimpleNamespace(world_size=3)))


def test_a_standalone_rank_beyond_the_rollout_configs_count_says_where_the_count_came_from(
        sglang_server, monkeypatch):
    """verl's main_generation_server counts replicas from trainer.n_gpus_per_node x nnodes over the
    TP size, a standalone replica from the rollout config's: when they disagree the refusal names
    the rollout config's numbers and that entry point (it used to blame separate-async mode only)."""
    from rollout_spec.distributed import sharing

    monkeypatch.setattr(sharing, "ensure_coordinators", lambda spec, n: pytest.fail("created"))
    _stub_router(monkeypatch)
    cfg = config({"speculative": "rollout_spec", "rollout_spec": {"shared_index": "gen"}})
    cfg.n_gpus_per_node, cfg.nnodes = 2, 1
    replica = sglang_server.RolloutSpecSGLangReplica(2, cfg)
    with pytest.raises(ValueError, match=r"\[0, 1\] \(2 replicas from actor_rollout_ref\.rollout\.n_gpus_per_node "
                                         r"x nnodes over 1 GPUs per replica\), got 2: .* main_generation_server"):
        asyncio.run(replica.init_standalone())


def test_a_replica_count_of_0_is_refused_naming_the_count_not_an_empty_rank_range(sglang_server, monkeypatch):
    """A worker group smaller than one replica counts 0 replicas: the refusal said ranks must be
    in [0, -1]; it names the count, where it came from and the least allowed."""
    from rollout_spec.distributed import sharing

    monkeypatch.setattr(sharing, "ensure_coordinators", lambda spec, n: pytest.fail("created"))
    _stub_router(monkeypatch)
    replica = sglang_server.RolloutSpecSGLangReplica(0, config({"speculative": "rollout_spec",
                                                                "rollout_spec": {"shared_index": "job-0"}}))
    replica.world_size = 2
    with pytest.raises(ValueError, match=r"shared_index needs at least 1 replica, got 0 \(the worker group's "
                                         r"size over 2 GPUs per replica\)") as err:
        asyncio.run(replica.init_hybrid(SimpleNamespace(world_size=1)))
    assert "[0, -1]" not in str(err.value)


def test_a_read_only_custom_config_is_refused_before_coordinators_are_made(sglang_server, monkeypatch):
    """With shared_index the replica records the replica count in ``custom`` for its servers: a
    read-only mapping (which the option parser reads fine) is refused by type, naming the field
    and what it must be, before any coordinator is created."""
    from rollout_spec.distributed import sharing
    from rollout_spec.integrations.verl.replicas import NUM_REPLICAS_KEY

    monkeypatch.setattr(sharing, "ensure_coordinators", lambda spec, n: pytest.fail("created"))
    _stub_router(monkeypatch)
    custom = types.MappingProxyType({"speculative": "rollout_spec", "rollout_spec": {"shared_index": "ro"}})
    replica = sglang_server.RolloutSpecSGLangReplica(0, config(custom))
    with pytest.raises(TypeError, match=r"actor_rollout_ref\.rollout\.custom must be a mutable dict with "
                                        r"shared_index .*, got mappingproxy"):
        asyncio.run(replica.init_hybrid(SimpleNamespace(world_size=1)))
    assert NUM_REPLICAS_KEY not in custom


def _stub_router(monkeypatch):
    router = types.ModuleType("verl.workers.rollout.router")
    router.get_router_handle = lambda servers, router_config_path=None, full_determinism=False, \
        load_balancer_cls=None: ("verl's", router_config_path)
    monkeypatch.setitem(sys.modules, router.__name__, router)
    return router


@pytest.mark.parametrize("role", ["is_reward_model", "is_teacher_model"])
def test_shared_index_is_refused_on_verls_reward_and_teacher_replicas(sglang_server, monkeypatch, role):
    """verl starts each reward/teacher replica with ``init_colocated`` on its own split of the pool
    (``split_resource_pool`` in reward_loop/reward_model.py and teacher_loop/teacher_model.py), so
    the count ``init_colocated`` derives is 1 for every replica: replica 0 would build coordinators
    for one replica and replica 1 fail with the separate-async message. Refused, saying why."""
    from rollout_spec.distributed import sharing

    made = []
    monkeypatch.setattr(sharing, "ensure_coordinators", lambda spec, n: made.append(n))
    _stub_router(monkeypatch)
    flag = {"speculative": "rollout_spec", "rollout_spec": {"shared_index": "judge"}}
    for rank in range(2):
        replica = sglang_server.RolloutSpecSGLangReplica(rank, config(dict(flag)), **{role: True})
        with pytest.raises(ValueError, match=r"shared_index is for the actor's rollout replicas: verl starts its "
                                             r"reward and teacher"):
            asyncio.run(replica.init_colocated(SimpleNamespace(world_size=1)))  # its own split of the pool
    assert made == [], "no coordinators for a replica count that is not the model's"
    drafting = sglang_server.RolloutSpecSGLangReplica(1, config({"speculative": "rollout_spec"}), **{role: True})
    asyncio.run(drafting.init_colocated(SimpleNamespace(world_size=1)))  # without shared_index it drafts
    assert drafting._server_address == "10.0.1.1:8000"


def test_shared_index_with_sglang_data_parallel_is_refused_before_launch(sglang_server):
    """verl launches SGLang with ``tp_size = tensor_model_parallel_size * data_parallel_size``
    (async_sglang_server.py), so dp=2 gives every scheduler a tensor-parallel group of 2, which
    the SGLang corpus refuses only inside SGLang's scheduler processes; the server refuses it first."""
    flag = {"speculative": "rollout_spec", "rollout_spec": {"shared_index": "job-9"},
            "rollout_spec_num_replicas": 2}
    server = sglang_server.RolloutSpecSGLangHttpServer(config(flag), replica_rank=0)
    server.config.data_parallel_size = 2
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size=1 and data_parallel_size=1 .*got 1 x 2"):
        asyncio.run(server.launch_server())
    assert not hasattr(server, "launched_with"), "refused before SGLang starts"


def test_an_empty_router_config_path_gets_our_balancer_as_verls_default_does(sglang_server, monkeypatch):
    """verl builds its user router only for a non-empty ``router_config_path`` (router.py:
    ``if router_config_path and load_balancer_cls is None``); an empty one is its default
    balancer, which our servers replace."""
    router = _stub_router(monkeypatch)
    replicas = [sglang_server.RolloutSpecSGLangReplica(r, config({"speculative": "rollout_spec"})) for r in range(2)]
    for replica in replicas:
        asyncio.run(replica.init_hybrid(SimpleNamespace(world_size=2)))
    ours = {r._server_address: f"h{i}" for i, r in enumerate(replicas)}
    monkeypatch.setattr(ray, "remote", lambda cls: SimpleNamespace(remote=lambda *args: cls(*args)))  # no cluster
    assert type(router.get_router_handle(ours, router_config_path="")).__name__ == "GroupStickyLoadBalancer"
    assert router.get_router_handle(ours, router_config_path="mine.yaml") == ("verl's", "mine.yaml")


def test_a_balancer_built_before_our_servers_routes_them_by_group_when_verl_adds_them(
        sglang_server, monkeypatch, caplog):
    """An empty ``servers`` is a balancer verl fills later: ours while servers of ours exist that
    no balancer has yet, with the same exceptions as a full one; another empty start is not ours."""
    from rollout_spec.integrations.verl import replicas as hook

    router = _stub_router(monkeypatch)
    replicas = [sglang_server.RolloutSpecSGLangReplica(r, config({"speculative": "rollout_spec"})) for r in range(2)]
    for replica in replicas:
        asyncio.run(replica.init_hybrid(SimpleNamespace(world_size=2)))
    monkeypatch.setattr(ray, "remote", lambda cls: SimpleNamespace(remote=lambda *args: cls(*args)))  # no cluster
    with caplog.at_level("WARNING", logger=hook.__name__):
        assert router.get_router_handle({}, full_determinism=True) == ("verl's", None)
    assert "group-sticky routing is off" in caplog.text
    hook._BALANCED.clear()
    assert router.get_router_handle({}, router_config_path="mine.yaml") == ("verl's", "mine.yaml")
    hook._BALANCED.clear()
    lb = router.get_router_handle({})
    assert type(lb).__name__ == "GroupStickyLoadBalancer" and lb.get_all_servers() == []
    assert router.get_router_handle({}) == ("verl's", None)  # our servers have their balancer


def test_an_empty_start_keeps_one_slot_per_address_of_ours(sglang_server, monkeypatch):
    """Two live replicas of one server (verl made the replica object again) gave the balancer one
    address twice in its slots, which it refuses: verl's balancer construction raised."""
    router = _stub_router(monkeypatch)
    replicas = [sglang_server.RolloutSpecSGLangReplica(r, config({"speculative": "rollout_spec"})) for r in (0, 1, 0)]
    for replica in replicas:
        asyncio.run(replica.init_hybrid(SimpleNamespace(world_size=2)))
    monkeypatch.setattr(ray, "remote", lambda cls: SimpleNamespace(remote=lambda *args: cls(*args)))  # no cluster
    lb = router.get_router_handle({})
    lb.add_servers({r._server_address: f"h{r.replica_rank}" for r in replicas})
    assert lb.get_all_servers() == ["10.0.0.0:8000", "10.0.0.1:8000"]


def test_two_empty_starts_at_once_claim_our_waiting_servers_once(sglang_server, monkeypatch):
    """A balancer's read of the waiting servers and its claim were two steps: two balancers built
    at once on two threads both took every slot, so both routed the same servers."""
    from rollout_spec.integrations.verl import replicas as hook

    router = _stub_router(monkeypatch)
    replicas = [sglang_server.RolloutSpecSGLangReplica(r, config({"speculative": "rollout_spec"})) for r in range(2)]
    for replica in replicas:
        asyncio.run(replica.init_hybrid(SimpleNamespace(world_size=2)))
    both_read = threading.Barrier(2, timeout=1.0)  # both threads between their read and their claim

    class MeetingClaims(set):
        def update(self, *claims):
            try:
                both_read.wait()
            except threading.BrokenBarrierError:  # the other thread did not read alongside
                pass
            super().update(*claims)

    monkeypatch.setattr(hook, "_BALANCED", MeetingClaims())
    monkeypatch.setattr(ray, "remote", lambda cls: SimpleNamespace(remote=lambda *args: cls(*args)))  # no cluster
    built = []
    threads = [threading.Thread(target=lambda: built.append(router.get_router_handle({}))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(type(lb).__name__ for lb in built) == ["GroupStickyLoadBalancer", "tuple"]


def _verl_class(rel: str, name: str, namespace: dict) -> type:
    """verl's class ``name`` from its installed source, compiled alone in ``namespace`` (its module
    imports uvicorn, SGLang's or torch's pieces, which a CPU test machine may lack)."""
    found = importlib.util.find_spec("verl")
    path = Path(list(found.submodule_search_locations)[0]) / rel
    node = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef) and n.name == name)
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), namespace)
    return namespace[name]


class _LocalActor:
    """A Ray actor handle's stand-in: ``handle.method.remote(...)`` runs the object's method here
    and returns a coroutine with its result (verl awaits what this test drives)."""

    def __init__(self, obj) -> None:
        self.obj = obj

    def __getattr__(self, name):
        async def call(*args, **kwargs):
            return getattr(self.obj, name)(*args, **kwargs)

        return SimpleNamespace(remote=call)


def _trainer_config(**rollout):
    from omegaconf import OmegaConf

    return OmegaConf.create({"actor_rollout_ref": {"model": {}, "rollout": {
        "name": "sglang", "custom": {"speculative": "rollout_spec"}, "engine_kwargs": {"sglang": {}}, "mtp": None,
        "disaggregation": {"enabled": False}, "tensor_model_parallel_size": 1, "data_parallel_size": 1,
        "pipeline_model_parallel_size": 1, "n_gpus_per_node": 2, "nnodes": 1, "prometheus": {"enable": False},
        "disable_log_stats": True, "router_config_path": None, "full_determinism": False, **rollout}}})


@pytest.fixture
def verl_managers(sglang_server, monkeypatch):
    """verl's ``LLMServerManager`` and ``FullyAsyncLLMServerManager`` from its source, over our
    SGLang replica (on the stand-in server), with verl's real router module and no Ray cluster."""
    verl_router = pytest.importorskip("verl.workers.rollout.router")
    from omegaconf import DictConfig, open_dict
    from verl.utils.ray_utils import auto_await

    from rollout_spec.integrations.verl import replicas as hook

    monkeypatch.setattr(verl_router, "get_router_handle", verl_router.get_router_handle)  # the hook, undone after
    monkeypatch.setattr(ray, "remote", lambda cls: SimpleNamespace(remote=lambda *a, **k: _LocalActor(cls(*a, **k))))
    ours = sglang_server.RolloutSpecSGLangReplica
    namespace = {"asyncio": asyncio, "auto_await": auto_await, "DictConfig": DictConfig, "RayWorkerGroup": object,
                 "RayResourcePool": object, "RolloutReplica": object, "LLMServerClient": object,
                 "FullyAsyncLLMServerClient": object,
                 "get_rollout_replica_class": lambda name, disaggregation_enabled: ours,
                 "RLInsightLogger": SimpleNamespace(enabled=lambda: False), "update_prometheus_config": None,
                 "open_dict": open_dict, "time": time, "logger": logging.getLogger("verl"), "ray": ray}
    namespace["LLMServerManager"] = _verl_class("workers/rollout/llm_server.py", "LLMServerManager", namespace)
    fully_async = _verl_class("experimental/fully_async_policy/fully_async_rollouter.py",
                              "FullyAsyncLLMServerManager", namespace)
    return namespace["LLMServerManager"], fully_async


def test_separate_async_without_hybrid_replicas_routes_its_standalone_servers_by_group(verl_managers):
    """``hybrid_engine=False``: verl's PPOTrainer._setup builds an empty manager (its balancer
    before any server, and before our hook exists), then the separate-async _setup starts the
    standalone manager, whose balancer (the one its client routes through) sees our servers."""
    manager, _ = verl_managers
    cfg = _trainer_config()
    empty = manager.create_empty(config=cfg)
    standalone = manager.create(config=cfg, start_rank=len(empty.rollout_replicas))
    assert type(empty.global_load_balancer.obj).__name__ == "GlobalRequestLoadBalancer"  # never routed through
    lb = standalone.global_load_balancer.obj
    assert type(lb).__name__ == "GroupStickyLoadBalancer" and lb.get_all_servers() == standalone.server_addresses
    assert len(standalone.server_addresses) == 2


def test_fully_async_hybrid_only_balancer_routes_our_servers_added_later_by_group(verl_managers):
    """verl's fully-async rollouter with no standalone rollout GPUs (dynamic resource scheduling)
    builds its balancer empty, then adds its hybrid servers: ours route by group, each server in
    its replica rank's slot whatever order they are added in, and one re-added counts nothing."""
    from rollout_spec.integrations.verl.routing import GroupStickyLoadBalancer

    _, fully_async = verl_managers

    async def run():
        manager = await fully_async.create(config=_trainer_config(nnodes=0), worker_group=SimpleNamespace(world_size=3))
        lb = manager.global_load_balancer.obj
        assert type(lb).__name__ == "GroupStickyLoadBalancer" and lb.get_all_servers() == []
        assert await manager.add_replicas(["hybrid_2", "hybrid_0", "hybrid_1"]) == 3
        by_rank = [manager.hybrid_replicas[f"hybrid_{r}"]._server_address for r in range(3)]
        assert lb.get_all_servers() == by_rank
        reference = GroupStickyLoadBalancer({sid: None for sid in by_rank})
        prompts = [[p, p + 1, p + 2] for p in range(12)]
        assert [lb.acquire_server(f"r{i}", prompt_ids=p)[0] for i, p in enumerate(prompts)] == \
               [reference.acquire_server(f"r{i}", prompt_ids=p)[0] for i, p in enumerate(prompts)]
        assert lb.acquire_server("again", prompt_ids=prompts[0])[0] == lb.acquire_server("r0")[0]
        busy = lb.acquire_server("r0")[0]
        assert await manager.remove_replicas(["hybrid_0", "hybrid_1", "hybrid_2"]) == 3
        assert await manager.add_replicas(["hybrid_0", "hybrid_1", "hybrid_2"]) == 3
        assert lb.get_status()["servers"][busy] == 0

    asyncio.run(run())


class _VllmEngine:
    def __init__(self) -> None:
        self.rpcs = []
        self.sampling_params = []  # what each request's SamplingParams were built from

    async def collective_rpc(self, method):
        self.rpcs.append(method)

    async def generate(self, prompt_ids, sampling_params, request_id=None):
        """Two tokens drafted for and both rejected, then nothing drafted: 5 response tokens."""
        self.sampling_params.append(sampling_params)
        counters = SimpleNamespace(num_spec_tokens=2, histogram=[1, 0, 0], num_draft_tokens=2)
        yield SimpleNamespace(metrics=None, outputs=[SimpleNamespace(token_ids=[7, 8, 9, 10, 11],
                                                                     spec_decode_metrics=counters)])


class vLLMHttpServer:
    """Stand-in for verl's vLLM server: config, the engine set by launch_server, set_global_steps."""

    def __init__(self, config, *args, replica_rank=0, **kwargs):
        self.config, self.replica_rank = config, replica_rank

    async def launch_server(self, *args, **kwargs):
        self.launched_with = dict(self.config.engine_kwargs.get("vllm") or {})
        self.engine = _VllmEngine()

    async def set_global_steps(self, global_steps):
        self.global_steps = global_steps

    async def generate(self, prompt_ids, sampling_params, request_id, *args, **kwargs):
        async for final in self.engine.generate(prompt_ids, sampling_params, request_id=request_id):
            pass
        if not final.outputs:  # verl's abort case: no tokens
            return SimpleNamespace(token_ids=[], extra_fields={})
        return SimpleNamespace(token_ids=list(final.outputs[0].token_ids), extra_fields={})


@pytest.fixture
def vllm_server(monkeypatch):
    fake = types.ModuleType("verl.workers.rollout.vllm_rollout.vllm_async_server")
    fake.vLLMHttpServer, fake.vLLMReplica = vLLMHttpServer, SGLangReplica
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    sys.modules.pop("rollout_spec.integrations.verl.vllm_server", None)
    yield importlib.import_module("rollout_spec.integrations.verl.vllm_server")
    sys.modules.pop("rollout_spec.integrations.verl.vllm_server", None)


def test_vllm_server_places_its_engine_and_ends_the_step_when_weights_change(vllm_server):
    flag = {"speculative": "rollout_spec", "rollout_spec": {"shared_index": "job-7"},
            "rollout_spec_num_replicas": 4}
    cfg = SimpleNamespace(name="vllm", custom=flag, engine_kwargs={}, mtp=None, disaggregation=None)
    server = vllm_server.RolloutSpecvLLMHttpServer(cfg, replica_rank=3)
    asyncio.run(server.launch_server())
    extra = server.launched_with["additional_config"]
    assert extra["rollout_spec_replica"] == {"replica_id": 3, "num_replicas": 4}
    assert extra["rollout_spec"]["shared_index"] == "job-7"
    for step in (1, 1, 2):  # verl may report the same weights twice: one boundary per new step
        asyncio.run(server.set_global_steps(step))
    assert server.engine.rpcs == ["rollout_spec_end_step"] * 2 and server.global_steps == 2
    off = vllm_server.RolloutSpecvLLMHttpServer(SimpleNamespace(name="vllm", custom=None, engine_kwargs={}))
    asyncio.run(off.launch_server())
    asyncio.run(off.set_global_steps(5))
    assert off.engine.rpcs == [] and "additional_config" not in off.launched_with


def test_shared_index_with_vllm_data_parallel_is_refused_before_launch(vllm_server):
    """verl runs vLLM's data-parallel engines inside one replica; each first-TP-rank worker shares
    its own index under the replica's id, and a replica never pulls its own publications back."""
    flag = {"speculative": "rollout_spec", "rollout_spec": {"shared_index": "job-7"},
            "rollout_spec_num_replicas": 2}
    cfg = SimpleNamespace(name="vllm", custom=flag, engine_kwargs={}, mtp=None, disaggregation=None,
                          data_parallel_size=2)
    server = vllm_server.RolloutSpecvLLMHttpServer(cfg, replica_rank=0)
    with pytest.raises(ValueError, match="shared_index needs data_parallel_size=1 with vLLM, got 2"):
        asyncio.run(server.launch_server())
    assert not hasattr(server, "launched_with"), "refused before vLLM starts"
    flag.pop("rollout_spec")  # drafting without a shared index works with data parallelism
    asyncio.run(vllm_server.RolloutSpecvLLMHttpServer(cfg, replica_rank=0).launch_server())


def test_vllm_later_turns_name_the_first_prompts_group_without_touching_the_callers_params(vllm_server):
    """The group reaches the engine in ``extra_args`` (vLLM builds ``SamplingParams(**params)``):
    the first prompt's, for a later turn too; verl's dict, reused across turns, is left as it was,
    and its own extra_args, a group it names itself included, are kept."""
    cfg = SimpleNamespace(name="vllm", custom={"speculative": "rollout_spec"}, engine_kwargs={}, mtp=None,
                          disaggregation=None)
    server = vllm_server.RolloutSpecvLLMHttpServer(cfg)
    asyncio.run(server.launch_server())
    params = {"temperature": 1.0, "extra_args": {"mine": 1}}
    for prompt, rid in (([1, 2, 3], "uuid-1"), ([1, 2, 3, 7, 8, 9, 40], "uuid-2"), ([1, 2, 4], "uuid-3")):
        asyncio.run(server.generate(prompt, params, rid))
    assert params == {"temperature": 1.0, "extra_args": {"mine": 1}}, "the caller's dict is not mutated"
    first, turn2, other = server.engine.sampling_params
    group = prompt_group_id([1, 2, 3])
    assert first == turn2 == {"temperature": 1.0, "extra_args": {"mine": 1, "rollout_spec_group": group}}
    assert other["extra_args"]["rollout_spec_group"] == prompt_group_id([1, 2, 4])
    asyncio.run(server.generate([1, 2, 3, 5], {"extra_args": {"rollout_spec_group": 5}}, "uuid-4"))
    assert server.engine.sampling_params[-1] == {"extra_args": {"rollout_spec_group": 5}}
    off = vllm_server.RolloutSpecvLLMHttpServer(SimpleNamespace(name="vllm", custom=None, engine_kwargs={}))
    asyncio.run(off.launch_server())
    asyncio.run(off.generate([1, 2, 3], params, "uuid-5"))
    assert off.engine.sampling_params == [params], "flag off: verl's parameters as they came"


def test_vllm_server_reports_every_decode_forward_as_a_verify_step(vllm_server):
    """vLLM counted one verify step (the one that drafted); the response's 5 tokens took the
    prefill and 4 decode forwards, which verl's accept length divides by."""
    flag = {"speculative": "rollout_spec"}
    cfg = SimpleNamespace(name="vllm", custom=flag, engine_kwargs={}, mtp=None, disaggregation=None)
    server = vllm_server.RolloutSpecvLLMHttpServer(cfg)
    asyncio.run(server.launch_server())
    out = asyncio.run(server.generate([1, 2, 3], {}, "req-1"))
    assert out.extra_fields == {"spec_num_draft_tokens": 2, "spec_num_accepted_tokens": 0,
                                "spec_num_verify_steps": 4}
    assert server._spec_stats == {}  # popped once reported


def test_vllm_server_reports_zero_counters_for_a_request_aborted_before_its_first_token(vllm_server, monkeypatch):
    """vLLM's final output of a request aborted before its first token has no sample, so no
    counters: the response ran no verify step, and reports zero of each like every other
    response of the batch (verl aggregates a batch only when every sample has the fields)."""
    async def aborted(self, prompt_ids, sampling_params, request_id=None):
        yield SimpleNamespace(metrics=None, outputs=[])

    monkeypatch.setattr(_VllmEngine, "generate", aborted)
    cfg = SimpleNamespace(name="vllm", custom={"speculative": "rollout_spec"}, engine_kwargs={}, mtp=None,
                          disaggregation=None)
    server = vllm_server.RolloutSpecvLLMHttpServer(cfg)
    asyncio.run(server.launch_server())
    out = asyncio.run(server.generate([1, 2, 3], {}, "req-aborted"))
    assert out.token_ids == []
    assert out.extra_fields == {"spec_num_draft_tokens": 0, "spec_num_accepted_tokens": 0,
                                "spec_num_verify_steps": 0}
    assert server._spec_stats == {}

"""What verl's replica objects add for scale-out: the replica count, the coordinators and the router.

verl builds one ``RolloutReplica`` per rollout replica in the trainer process, then the global
load balancer over their servers. :class:`ScaleOutReplicaMixin` (mixed into our SGLang and vLLM
replicas) learns the replica count when verl initialises the replica, stores it in the rollout
config's ``custom`` dict (which travels to the server actor), creates the shared-index
coordinators when ``shared_index`` is set, and registers its server so that
:func:`install_router_hook` makes verl's default router the group-sticky one. Nothing here
imports verl at module level.
"""
from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Mapping, MutableMapping
from typing import Any, Optional

from rollout_spec.config import SpecConfig
from rollout_spec.distributed.placement import ReplicaPlacement
from rollout_spec.integrations.verl.config import spec_from_rollout_config

logger = logging.getLogger(__name__)

NUM_REPLICAS_KEY = "rollout_spec_num_replicas"
"""Key in ``actor_rollout_ref.rollout.custom`` where the replica count reaches the server."""
_SPEC_REPLICAS: "weakref.WeakSet[Any]" = weakref.WeakSet()  # replicas with the flag, this process
_BALANCED: set[str] = set()  # server addresses some balancer was built over, this process
_BALANCED_LOCK = threading.Lock()  # a balancer's read of _BALANCED and its claim are one step
_HOOK_MARK = "_rollout_spec_router_hook"


class ScaleOutReplicaMixin:
    """Put before verl's ``SGLangReplica``/``vLLMReplica`` (after our own replica class body)."""

    async def init_hybrid(self, worker_group: Any) -> None:
        """verl's hybrid start; the replica count is the worker group's size over ours."""
        self._scale_out(worker_group.world_size // self.world_size, "the worker group's size")
        await super().init_hybrid(worker_group)

    async def init_hybrid_colocated(self, worker_group: Any, resource_pool: Any) -> None:
        """verl's hybrid start for engines that need a resource pool (same count as hybrid)."""
        self._scale_out(worker_group.world_size // self.world_size, "the worker group's size")
        await super().init_hybrid_colocated(worker_group, resource_pool)

    async def init_colocated(self, resource_pool: Any) -> None:
        """verl's colocated start; the pool holds every replica's processes. (verl's own callers,
        its reward and teacher models, pass each replica its own split of the pool instead:
        ``_scale_out`` refuses ``shared_index`` for those replicas.)"""
        self._scale_out(resource_pool.world_size // self.world_size, "the resource pool's size")
        await super().init_colocated(resource_pool)

    async def init_standalone(self) -> None:
        """verl's standalone start; the count is what verl's LLMServerManager computes (verl's
        ``main_generation_server`` counts from ``trainer``'s GPUs and the TP size instead)."""
        self._scale_out(self.config.n_gpus_per_node * self.config.nnodes // self.world_size,
                        "actor_rollout_ref.rollout.n_gpus_per_node x nnodes")
        await super().init_standalone()

    def _scale_out(self, num_replicas: int, counted_from: str) -> None:
        """Record ``num_replicas`` (derived from ``counted_from``, over this replica's world size)
        for the servers, install the router and, with ``shared_index``, create the coordinators."""
        spec = spec_from_rollout_config(self.config)
        if spec is None:
            return
        _SPEC_REPLICAS.add(self)
        install_router_hook()
        if spec.shared_index is None:
            return
        if getattr(self, "is_reward_model", False) or getattr(self, "is_teacher_model", False):
            raise ValueError(
                "custom.rollout_spec.shared_index is for the actor's rollout replicas: verl starts its "
                "reward and teacher model replicas each on its own part of their pool (or from their "
                "own GPU count), so their replica count is not known here; leave shared_index unset "
                "in their rollout config")
        if num_replicas < 1:
            raise ValueError(
                f"actor_rollout_ref.rollout.custom.rollout_spec.shared_index needs at least 1 replica, got "
                f"{num_replicas} ({counted_from} over {self.world_size} GPUs per replica): fewer GPUs "
                "than one replica uses")
        if not 0 <= self.replica_rank < num_replicas:
            raise ValueError(
                f"actor_rollout_ref.rollout.custom.rollout_spec.shared_index needs replica ranks in "
                f"[0, {num_replicas - 1}] ({num_replicas} replicas from {counted_from} over "
                f"{self.world_size} GPUs per replica), got {self.replica_rank}: verl's separate-async "
                "trainer ranks its standalone replicas after the hybrid ones, and its "
                "main_generation_server counts replicas from trainer.n_gpus_per_node x nnodes over the "
                "TP size; one shared index covers neither, so leave shared_index unset there")
        ReplicaPlacement(self.replica_rank, num_replicas)
        custom = self.config.custom
        if not isinstance(custom, MutableMapping):
            raise TypeError(f"actor_rollout_ref.rollout.custom must be a mutable dict with shared_index (the "
                            f"replica count is recorded in it), got {type(custom).__name__}")
        custom[NUM_REPLICAS_KEY] = int(num_replicas)
        from rollout_spec.distributed.sharing import ensure_coordinators

        ensure_coordinators(spec, num_replicas)  # the trainer process owns them: they live as long as the job


def server_placement(config: Any, spec: SpecConfig, replica_rank: int) -> Optional[ReplicaPlacement]:
    """A server's placement for ``spec.shared_index`` (None without it).

    Raises:
        ValueError: the replica count did not reach the server (its replica is not ours).
    """
    if spec.shared_index is None:
        return None
    custom = getattr(config, "custom", None) or {}
    count = custom.get(NUM_REPLICAS_KEY) if isinstance(custom, Mapping) else None
    if count is None:
        raise ValueError(
            f"shared_index={spec.shared_index!r}: the replica count is missing from the rollout config; "
            "start verl with rollout-spec's replica classes (the verl.plugins entry point)"
        )
    return ReplicaPlacement(int(replica_rank), int(count))


def _servers_for_group_routing(servers: Mapping[str, Any]) -> list[str]:
    """The server addresses a default balancer built over ``servers`` would route for us, in slot
    order; empty when they are not all ours.

    A balancer built before its servers (``servers`` empty: verl's fully-async rollouter with
    dynamic resource scheduling and no standalone rollout GPUs builds it, then adds its hybrid
    servers) is ours when servers of ours exist that no balancer was built over yet: those, by
    replica rank, are the ones verl will add; an address two replicas share (a replica object
    verl made again for one server) takes one slot.
    """
    ours = [r for r in list(_SPEC_REPLICAS) if getattr(r, "_server_address", None)]
    if servers:
        return list(servers) if set(servers) <= {r._server_address for r in ours} else []
    waiting = [r for r in ours if r._server_address not in _BALANCED]
    return list(dict.fromkeys(r._server_address for r in sorted(waiting, key=lambda r: r.replica_rank)))


def _claim_servers_for_group_routing(servers: Mapping[str, Any]) -> list[str]:
    """:func:`_servers_for_group_routing`, with ``servers`` and those slots marked as having a
    balancer in the same step, so two balancers built at once never claim one slot twice."""
    with _BALANCED_LOCK:
        slots = _servers_for_group_routing(servers)
        _BALANCED.update(servers, slots)  # an empty start's slots are claimed by whichever balancer it is
        return slots


def install_router_hook() -> bool:
    """Make verl's router factory pick ``GroupStickyLoadBalancer`` for our servers; idempotent.

    It applies only when verl would build its default balancer (no or an empty ``router_config_path``, no
    injected ``load_balancer_cls``, no ``full_determinism``: verl then routes by request id so
    that a rerun samples on the same replicas) and every server belongs to a replica with the flag
    on, so a user's own router and other models' servers (reward, teacher) keep verl's choice. A
    balancer built with no server is ours when servers of ours exist that no balancer has yet
    (:func:`_servers_for_group_routing`). Returns True when the hook was installed by this call.
    """
    from importlib import import_module

    verl_router = import_module("verl.workers.rollout.router")  # the module verl's manager imports from
    original = verl_router.get_router_handle
    if getattr(original, _HOOK_MARK, False):
        return False

    def get_router_handle(servers: dict[str, Any], router_config_path: Optional[str] = None,
                          full_determinism: bool = False, load_balancer_cls: Optional[type] = None) -> Any:
        slots = _claim_servers_for_group_routing(servers)
        if full_determinism and slots:
            logger.warning("rollout-spec: full_determinism keeps verl's deterministic routing (by request "
                           "id); group-sticky routing is off, so a prompt's samples may scatter over replicas")
        elif not router_config_path and load_balancer_cls is None and slots:
            import ray

            from rollout_spec.integrations.verl.routing import GroupStickyLoadBalancer

            # slots lists servers themselves, or (an empty start) the servers of ours verl adds later
            logger.info("rollout-spec: group-sticky routing over %d servers (%d to be added)", len(slots),
                        len(slots) - len(servers))
            return ray.remote(GroupStickyLoadBalancer).remote(servers, {}, slots)
        return original(servers, router_config_path=router_config_path, full_determinism=full_determinism,
                        load_balancer_cls=load_balancer_cls)

    setattr(get_router_handle, _HOOK_MARK, True)
    verl_router.get_router_handle = get_router_handle
    return True

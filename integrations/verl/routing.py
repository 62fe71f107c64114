"""Group-sticky routing for verl's rollout servers (verl >= 0.9's pluggable load balancer).

verl sends every agent-loop request through one global load-balancer actor. Its default sends a
new request to the least-loaded server, so the n samples of a prompt scatter over the replicas
and the prompt lands elsewhere at the next step: each drafter sees a fraction of its siblings and
history. :class:`GroupStickyLoadBalancer` keys each new request by its prompt's group (the hash
of the prompt token ids that the vLLM/SGLang adapters use as the drafter's group id) and places
it with :class:`rollout_spec.distributed.GroupRouter`: the group's ranked first choice while
that server is under its bounded share, else its next choice. Later turns of a multi-turn
request stay on their first server, as verl's default does for prefix caching. A call the
balancer takes for a new request (its sticky session forgotten by ``clear_sticky_cache``, say)
whose prompt extends a prompt seen before (a later turn, a resumed tail) is routed by that
prompt's group (:class:`rollout_spec.prompt_roots.PromptRoots`), as the servers draft it.

Enable it with a router YAML (``actor_rollout_ref.rollout.router_config_path=...``)::

    router_class: rollout_spec.integrations.verl.routing.GroupStickyLoadBalancer
    load_factor: 1.1      # optional, GroupRouter's arguments
    slack: 8

Server ``i`` of verl's initial server list is replica ``i`` of the router, so a replica's
``SharedIndexConfig.replica_id`` is its ``replica_rank``.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from rollout_spec.config import check_int
from rollout_spec.distributed import GroupRouter
from rollout_spec.prompt_roots import PromptRoots

logger = logging.getLogger(__name__)

# GroupRouter's arguments a router YAML may set; not its seed, which must stay the shared index's
# (SharedIndexConfig.router_seed, 0 through verl) so that a group's replica owns its index share.
_ROUTER_ARGS = ("load_factor", "slack", "max_sticky_groups")


class GroupStickyLoadBalancer:
    """verl's ``RequestLoadBalancer`` protocol, routing by prompt group with bounded load.

    Args:
        servers: verl's ``{server_address: actor_handle}``, in replica-rank order.
        config: the router YAML as a dict (``router_class`` plus optional GroupRouter arguments).
        slots: addresses of servers verl adds later (a balancer built before its servers), in
            replica-rank order after ``servers``: each is out of service until added, then takes
            its slot, so slot i stays replica i whatever order verl adds them in.

    Raises:
        ValueError: an unknown or out-of-range config key, or an address twice in ``slots``.
    """

    def __init__(self, servers: Mapping[str, Any], config: Optional[Mapping[str, Any]] = None,
                 slots: Sequence[str] = ()) -> None:
        config = dict(config or {})
        seed = config.pop("seed", 0)
        if type(seed) is not int or seed != 0:
            raise ValueError("router config: seed must be 0, the shared index's (a group's requests must reach "
                             f"the replica that owns its share of the index), got {seed!r}")
        allowed = ["router_class", *_ROUTER_ARGS, "max_cache_size", "seed (0 only)"]
        unknown = set(config) - set(allowed)
        if unknown:
            raise ValueError(f"router config: unknown keys {sorted(unknown)}; allowed: {allowed}")
        if len(set(slots)) != len(slots):
            raise ValueError(f"slots: each server address once, got {list(slots)}")
        self._ids: list[str] = list(servers) + [sid for sid in slots if sid not in servers]
        self._handles: dict[str, Any] = dict(servers)
        self._slot = {sid: i for i, sid in enumerate(self._ids)}
        self._router = GroupRouter(max(len(self._ids), 1), **{k: config[k] for k in _ROUTER_ARGS if k in config})
        if not self._ids:
            self._router.set_available(0, False)
        for sid in self._ids[len(self._handles):]:  # reserved for a server verl adds later
            self._router.set_available(self._slot[sid], False)
        self._by_request: OrderedDict[str, str] = OrderedDict()  # request id -> server, LRU
        self._prompt_roots = PromptRoots()  # a later call's group is its first prompt's
        self._max_requests = check_int("router config max_cache_size", config.get("max_cache_size", 10_000),
                                       1, 1 << 30)

    def require_acquire_fields(self) -> list[str]:
        """verl serialises only these ``generate()`` kwargs into :meth:`acquire_server`."""
        return ["prompt_ids"]

    def require_release_fields(self) -> list[str]:
        """Releases count by server id alone."""
        return []

    def acquire_server(self, request_id: str, prompt_ids: Optional[Sequence[int]] = None, **_: Any) -> tuple[str, Any]:
        """The server for one request: its earlier turn's server, else its group's placement (the
        group of the longest prompt seen before that ``prompt_ids`` extends, else its own).

        Raises:
            RuntimeError: no server is registered.
            ValueError: ``prompt_ids`` missing for a new request (verl always sends it).
        """
        sid = self._by_request.get(request_id)
        if sid is not None and sid in self._handles:
            self._router.hold(self._slot[sid])
            self._by_request.move_to_end(request_id)
            return sid, self._handles[sid]
        if not self._handles:
            raise RuntimeError("No available servers in load balancer")
        if prompt_ids is None:
            raise ValueError("prompt_ids is required to route a new request by its group")
        sid = self._ids[self._router.acquire(self._prompt_roots.group_of(prompt_ids))]
        self._by_request[request_id] = sid
        if len(self._by_request) > self._max_requests:
            self._by_request.popitem(last=False)
        return sid, self._handles[sid]

    def release_server(self, server_id: str, request_id: Optional[str] = None) -> None:
        """One request on ``server_id`` finished (unknown or removed servers are ignored)."""
        slot = self._slot.get(server_id)
        if server_id in self._handles and slot is not None and self._router.inflight()[slot] > 0:
            self._router.release(slot)

    def add_servers(self, servers: Mapping[str, Any]) -> None:
        """Register servers; a returning one gets its old slot (and so its groups) back."""
        new = [sid for sid in servers if sid not in self._slot]
        if new:
            if self._ids:
                self._router.grow(len(new))
            else:  # the placeholder slot of an empty start becomes the first server
                self._router.set_available(0, True)
                if len(new) > 1:
                    self._router.grow(len(new) - 1)
            for sid in new:
                self._slot[sid] = len(self._ids)
                self._ids.append(sid)
        for sid, handle in servers.items():
            if sid not in self._handles:  # (re)joining: it starts with nothing in flight, as in verl's
                self._router.reset_load(self._slot[sid])
            self._handles[sid] = handle
            self._router.set_available(self._slot[sid], True)

    def remove_servers(self, server_ids: list[str]) -> None:
        """Take servers out; their groups move to their next ranked choices, and what they held
        in flight is no longer counted (verl aborts it; its releases for a removed server are
        ignored)."""
        for sid in server_ids:
            if self._handles.pop(sid, None) is not None:
                self._router.set_available(self._slot[sid], False)
                self._router.reset_load(self._slot[sid])

    def get_all_servers(self) -> list[str]:
        """Active server ids."""
        return [sid for sid in self._ids if sid in self._handles]

    def get_status(self) -> dict:
        """In-flight requests per active server (verl's debugging view)."""
        inflight = self._router.inflight()
        servers = {sid: int(inflight[self._slot[sid]]) for sid in self.get_all_servers()}
        return {"servers": servers, "total_inflight": sum(servers.values()), "active_servers": len(servers),
                "registered_handles": list(self._handles)}

    def clear_sticky_cache(self) -> dict:
        """Forget per-request and per-group stickiness (groups return to their ranked choices)."""
        cleared = len(self._by_request) + self._router.clear_sticky()
        self._by_request.clear()
        return {"cleared_entries": cleared, "server_loads": self.get_status()["servers"]}

    def get_total_inflight(self) -> int:
        """In-flight requests over all active servers."""
        return self.get_status()["total_inflight"]

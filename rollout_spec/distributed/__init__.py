"""Scale-out across rollout replicas: group-sticky routing and a drafter index shared over Ray.

The router needs only numpy; the shared index imports Ray when it is used (``pip install
rollout-spec[ray]``).
"""
from __future__ import annotations

from rollout_spec.distributed.keys import group_key, group_keys
from rollout_spec.distributed.router import GroupRouter
from rollout_spec.lazy_imports import lazy_attributes

_LAZY = {
    "IndexCoordinator": "rollout_spec.distributed.coordinator",
    "coordinator_handles": "rollout_spec.distributed.coordinator",
    "coordinators_retain_steps": "rollout_spec.distributed.coordinator",
    "create_coordinators": "rollout_spec.distributed.coordinator",
    "default_num_shards": "rollout_spec.distributed.coordinator",
    "destroy_coordinators": "rollout_spec.distributed.coordinator",
    "ReplicaPlacement": "rollout_spec.distributed.placement",
    "placement_from_env": "rollout_spec.distributed.placement",
    "SharingDrafter": "rollout_spec.distributed.sharing",
    "ensure_coordinators": "rollout_spec.distributed.sharing",
    "share_drafter": "rollout_spec.distributed.sharing",
    "SharedIndexClient": "rollout_spec.distributed.shared_index",
    "SharedIndexConfig": "rollout_spec.distributed.shared_index",
}

__all__ = ["GroupRouter", "group_key", "group_keys", *_LAZY]

__getattr__ = lazy_attributes(__name__, _LAZY)

"""Where a rollout replica sits in the job: its rank and the replica count.

The framework hooks know both (verl's ``replica_rank``, OpenRLHF's engine index) and hand them to
the processes that build drafters: through vLLM's ``additional_config`` or through two
environment variables that SGLang's scheduler processes (and any user process) inherit.
"""
from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, Optional

from rollout_spec.config import check_int

ENV_REPLICA_ID = "ROLLOUT_SPEC_REPLICA_ID"
ENV_NUM_REPLICAS = "ROLLOUT_SPEC_NUM_REPLICAS"
NAMESPACE = "rollout-spec"
"""Ray namespace of the coordinators the hooks create: engine processes that join the cluster on
their own (vLLM/SGLang subprocesses) would otherwise land in a fresh anonymous namespace."""


@dataclass(frozen=True)
class ReplicaPlacement:
    """This replica's index in ``[0, num_replicas)`` and the number of rollout replicas."""

    replica_id: int
    num_replicas: int

    def __post_init__(self) -> None:
        # frozen: store the checked plain ints (an np.int64 would not serialise to JSON)
        object.__setattr__(self, "num_replicas", check_int("num_replicas", self.num_replicas, 1, 1 << 16))
        object.__setattr__(self, "replica_id", check_int("replica_id", self.replica_id, 0, self.num_replicas - 1))

    def as_dict(self) -> dict[str, int]:
        """Plain form for vLLM's additional_config and JSON."""
        return {"replica_id": self.replica_id, "num_replicas": self.num_replicas}

    @staticmethod
    def from_dict(value: Mapping[str, Any]) -> "ReplicaPlacement":
        """Inverse of :meth:`as_dict`; raises naming a missing or bad key."""
        if not isinstance(value, Mapping) or set(value) != {"replica_id", "num_replicas"}:
            raise ValueError(f"replica placement must be {{'replica_id': int, 'num_replicas': int}}, got {value!r}")
        return ReplicaPlacement(value["replica_id"], value["num_replicas"])

    def to_env(self, environ: Optional[MutableMapping[str, str]] = None) -> None:
        """Store the placement for child processes (default ``os.environ``; else a mutable
        mapping, or a TypeError)."""
        env = os.environ if environ is None else environ
        if not isinstance(env, MutableMapping):
            raise TypeError(f"environ must be a mutable mapping or None, got {type(environ).__name__}")
        env[ENV_REPLICA_ID] = str(self.replica_id)
        env[ENV_NUM_REPLICAS] = str(self.num_replicas)


def placement_from_env(environ: Optional[Mapping[str, str]] = None) -> Optional[ReplicaPlacement]:
    """The placement stored by :meth:`ReplicaPlacement.to_env`, or None when neither variable is set.

    Raises:
        TypeError: ``environ`` is neither None nor a mapping.
        ValueError: only one of the two is set, or a value is not plain decimal digits (no sign,
            space, underscore or non-ASCII digit) of an integer in range.
    """
    env = os.environ if environ is None else environ
    if not isinstance(env, Mapping):
        raise TypeError(f"environ must be a mapping or None, got {type(environ).__name__}")
    rid, num = env.get(ENV_REPLICA_ID), env.get(ENV_NUM_REPLICAS)
    if rid is None and num is None:
        return None
    if rid is None or num is None:
        raise ValueError(f"set both {ENV_REPLICA_ID} and {ENV_NUM_REPLICAS}, or neither")
    for var, text in ((ENV_REPLICA_ID, rid), (ENV_NUM_REPLICAS, num)):
        if not (text.isascii() and text.isdigit()):
            raise ValueError(f"{var} must be plain decimal digits, got {text!r}")
    try:
        return ReplicaPlacement(int(rid), int(num))
    except ValueError as exc:
        raise ValueError(f"{ENV_REPLICA_ID}={rid!r}, {ENV_NUM_REPLICAS}={num!r}: {exc}") from exc

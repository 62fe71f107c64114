"""verl plugin (entry point ``verl.plugins: rollout_spec``): route verl's sglang/vllm replicas
through rollout-spec's subclasses (``sglang_server.py``, ``vllm_server.py``), which act only when the config flag is on,
and let verl's v1 trainer log their acceptance counters (``trainer_metrics.py``).

verl loads every ``verl.plugins`` entry point when ``verl`` is imported, in every process (the
trainer, the agent-loop workers, the rollout servers). Registration only wraps the loaders of
verl's ``RolloutReplicaRegistry`` and its ``get_rollout_replica_class``; verl's server modules are
imported only when a replica class is looked up.
"""
from __future__ import annotations

import sys
from importlib import import_module
from typing import Callable

from rollout_spec.integrations.verl.config import spec_from_rollout_config

BACKENDS = ("sglang", "vllm")
_REPLICAS = {
    "sglang": ("rollout_spec.integrations.verl.sglang_server", "RolloutSpecSGLangReplica"),
    "vllm": ("rollout_spec.integrations.verl.vllm_server", "RolloutSpecvLLMReplica"),
}


def _wrap(upstream: Callable[[], type], backend: str) -> Callable[[], type]:
    def load() -> type:
        upstream()  # verl's own loader first: it prepares the environment its imports need
        # The trainer's process looks the replica class up while building its servers: the v1
        # trainer is loaded there by then, and its metrics need our counters passed through.
        import_module("rollout_spec.integrations.verl.trainer_metrics").install()
        module, name = _REPLICAS[backend]
        return getattr(import_module(module), name)

    load.rollout_spec_wrapped = True  # type: ignore[attr-defined]
    return load


def _refusing_flag(pd_class: type) -> type:
    """verl's PD replica class, refusing the flag when a replica is built (ours do not do PD)."""

    def __init__(self, *args, **kwargs) -> None:
        pd_class.__init__(self, *args, **kwargs)
        spec_from_rollout_config(self.config)  # with the flag on, the ValueError naming disaggregation

    return type(pd_class.__name__, (pd_class,), {"__init__": __init__, "__module__": __name__,
                                                 "__doc__": pd_class.__doc__})


def _wrap_resolver(upstream: Callable[..., type]) -> Callable[..., type]:
    """verl's ``get_rollout_replica_class``: a PD-disaggregated rollout resolves to verl's own PD
    replica classes without our loaders, so the flag would be ignored (vLLM) or refused only by
    the trainer's metrics after a whole step (SGLang); refuse it when the replica is built."""
    pd_classes: dict[type, type] = {}

    def get_rollout_replica_class(rollout: str, disaggregation_enabled: bool = False) -> type:
        cls = upstream(rollout, disaggregation_enabled=disaggregation_enabled)
        if not disaggregation_enabled or rollout not in BACKENDS:
            return cls
        if cls not in pd_classes:
            pd_classes[cls] = _refusing_flag(cls)
        return pd_classes[cls]

    get_rollout_replica_class.rollout_spec_wrapped = True  # type: ignore[attr-defined]
    return get_rollout_replica_class


def register() -> list[str]:
    """Wrap the sglang and vllm replica loaders, and verl's PD resolution, once; returns the
    backends wrapped now."""
    from verl.workers.rollout import replica
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    done = []
    for backend in BACKENDS:
        upstream = RolloutReplicaRegistry._registry.get(backend)
        if upstream is None:
            raise RuntimeError(f"verl's RolloutReplicaRegistry has no {backend!r} loader to wrap")
        if getattr(upstream, "rollout_spec_wrapped", False):
            continue
        RolloutReplicaRegistry.register(backend, _wrap(upstream, backend))
        done.append(backend)
    resolver = getattr(replica, "get_rollout_replica_class", None)
    if resolver is None:
        raise RuntimeError("verl.workers.rollout.replica has no get_rollout_replica_class to wrap")
    if not getattr(resolver, "rollout_spec_wrapped", False):
        replica.get_rollout_replica_class = _wrap_resolver(resolver)
    # llm_server.py imports the resolver by name: verl loads plugins before that module, but
    # should it be loaded already, its copy of the name is rebound too.
    server = sys.modules.get("verl.workers.rollout.llm_server")
    if server is not None and hasattr(server, "get_rollout_replica_class"):
        server.get_rollout_replica_class = replica.get_rollout_replica_class
    return done


# verl's plugin loader imports this module and calls nothing, so registration runs on import.
# verl logs a failing plugin only at debug level; log ours at warning level so it is seen.
try:
    register()
except Exception:  # noqa: BLE001 -- re-raised by verl's loader as a debug line otherwise
    import logging

    logging.getLogger(__name__).warning("rollout-spec: verl plugin registration failed", exc_info=True)
    raise

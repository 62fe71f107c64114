"""verl plugin (entry point ``verl.plugins: rollout_spec``): route verl's sglang/vllm replicas
through rollout-spec's subclasses (``sglang_server.py``, ``vllm_server.py``), which act only when the config flag is on,
and let verl's v1 trainer log their acceptance counters (``trainer_metrics.py``).

verl loads every ``verl.plugins`` entry point when ``verl`` is imported, in every process (the
trainer, the agent-loop workers, the rollout servers). Registration only wraps the loaders of
verl's ``RolloutReplicaRegistry``; verl's server modules are imported only when a replica class is looked up.
"""
from __future__ import annotations

from importlib import import_module
from typing import Callable

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


def register() -> list[str]:
    """Wrap the sglang and vllm replica loaders once; returns the backends wrapped now."""
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
    return done


# verl's plugin loader imports this module and calls nothing, so registration runs on import.
# verl logs a failing plugin only at debug level; log ours at warning level so it is seen.
try:
    register()
except Exception:  # noqa: BLE001 -- re-raised by verl's loader as a debug line otherwise
    import logging

    logging.getLogger(__name__).warning("rollout-spec: verl plugin registration failed", exc_info=True)
    raise

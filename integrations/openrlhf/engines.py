"""OpenRLHF's vLLM engines and PPO trainer, extended for speculative rollouts.

OpenRLHF builds its engines in ``create_vllm_engines`` with fixed engine arguments and runs its
trainer as a Ray actor, so a patch in the launcher process would not reach either. Instead we
subclass both Ray actor classes (Ray imports our subclasses in its actor processes):
``SpecEngineMixin`` adds our engine arguments and two remote methods to ``RolloutRayActor``;
``SpecTrainerMixin`` ends each PPO ``train_step`` -- right after the new weights reach vLLM, the
RL step boundary -- by refreshing the drafters and returning acceptance in the step's status,
which OpenRLHF logs to wandb/tensorboard under ``train/``. It also makes the trainer's
``SamplesGenerator`` send each prompt to its group's engine (``routing.py``). With
``SpecConfig.shared_index`` the engine factory creates the index coordinators (in the launcher,
which lives as long as the job) and gives engine ``i`` its placement ``(i, num_engines)``.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Optional, Sequence

from rollout_spec.config import SpecConfig
from rollout_spec.distributed.placement import ReplicaPlacement
from rollout_spec.integrations.vllm.config import REPLICA_CONFIG_KEY
from rollout_spec.integrations.vllm.metrics import SpecDecodeCounters

ENGINE_KWARGS_ARG = "rollout_spec_engine_kwargs"


def _counters_now() -> SpecDecodeCounters:
    from vllm.v1.metrics.reader import get_metrics_snapshot

    return SpecDecodeCounters.from_metrics(get_metrics_snapshot())


class SpecEngineMixin:
    """Put before ``RolloutRayActor``: passes our engine arguments to ``vllm.AsyncEngineArgs``."""

    async def __init__(self, *args: Any, rollout_spec_engine_kwargs: dict, **kwargs: Any) -> None:
        clash = sorted(set(kwargs) & set(rollout_spec_engine_kwargs) - {"disable_log_stats"})
        if clash:
            raise ValueError(f"OpenRLHF already sets {clash}; rollout-spec cannot override them")
        kwargs.update(rollout_spec_engine_kwargs)
        await super().__init__(*args, **kwargs)
        self._rollout_spec_seen = _counters_now()

    async def rollout_spec_end_step(self) -> tuple[SpecDecodeCounters, list[dict]]:
        """RL step boundary: refresh every worker's drafter; return this engine's spec-decode
        counters since the previous call and each worker's drafter counters."""
        workers = await self.llm.collective_rpc("rollout_spec_end_step")
        now = _counters_now()
        step, self._rollout_spec_seen = now - self._rollout_spec_seen, now
        return step, list(workers)


class SpecTrainerMixin:
    """Put before OpenRLHF's trainer class: adds acceptance to every train step's status and
    routes prompts to engines sticky by prompt."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        generator = getattr(self, "samples_generator", None)
        if generator is not None and getattr(generator, "vllm_engines", None):
            from rollout_spec.integrations.openrlhf.routing import route_dispatch_by_group

            route_dispatch_by_group(generator)

    def train_step(self, rollout_samples: Any, global_step: int) -> tuple[dict, int]:
        """OpenRLHF's step (experience, PPO update, weight broadcast to vLLM), then the drafter
        refresh and this step's acceptance as ``rollout/spec_*`` entries of the status."""
        status, next_step = super().train_step(rollout_samples, global_step)
        if self.vllm_engines:
            status.update(end_step_and_collect(self.vllm_engines))
        return status, next_step


def end_step_and_collect(engines: Sequence[Any]) -> dict[str, float]:
    """Call ``rollout_spec_end_step`` on every engine actor; merge into one log dict."""
    import ray

    results = ray.get([engine.rollout_spec_end_step.remote() for engine in engines])
    return merge_step_results(results)


MAX_OVER_ENGINES = frozenset({"steps_ended", "drafter/step", "drafter/shared_index/apply_max_s"})
"""Worker figures that are the same RL step on every engine, or a maximum: merged by max, not
summed (two engines after three steps have ended step 3, not 6)."""


def merge_step_results(results: Sequence[tuple[SpecDecodeCounters, list[dict]]]) -> dict[str, float]:
    """Sum engines' spec-decode counters of the step; add the proposer and drafter figures of
    each engine's first worker (its tensor-parallel peers hold identical drafters): summed over
    engines (totals since launch, index sizes at the step's end), except ``MAX_OVER_ENGINES``."""
    total = SpecDecodeCounters()
    drafter: dict[str, float] = {}
    for counters, workers in results:
        total = total + counters
        for key, value in (workers[0] if workers else {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                name = "rollout/spec_" + key.replace("/", "_")
                merge = max if key in MAX_OVER_ENGINES else float.__add__
                drafter[name] = merge(drafter[name], float(value)) if name in drafter else float(value)
    return {**total.as_log_dict("rollout/"), **drafter}


def actor_subclass(mixin: type, remote_cls: Any, name: str) -> Any:
    """A Ray actor class running ``mixin`` over the class behind ``remote_cls`` (a Ray
    ``ActorClass``), with the same default actor options."""
    import ray

    base = getattr(remote_cls, "__ray_actor_class__", None)
    if base is None:
        raise TypeError(f"{remote_cls!r} is not a Ray actor class (no __ray_actor_class__)")
    options = dict(getattr(remote_cls, "_default_options", None) or {})
    cls = type(name, (mixin, base), {"__module__": __name__})
    return ray.remote(**options)(cls) if options else ray.remote(cls)


class _InjectKwargs:
    """Stands in for ``RolloutRayActor`` inside ``create_vllm_engines``: same ``options().remote()``
    calls, with our engine arguments added to every actor it starts. With ``num_engines`` the
    i-th actor started (OpenRLHF starts engine i i-th) also gets its replica placement."""

    def __init__(self, actor_cls: Any, engine_kwargs: dict, options: dict | None = None,
                 num_engines: Optional[int] = None, started: Optional[list[int]] = None) -> None:
        self._cls, self._kwargs, self._options = actor_cls, engine_kwargs, options
        self._num_engines, self._started = num_engines, started if started is not None else [0]

    def options(self, **options: Any) -> "_InjectKwargs":
        """Ray's ``options``: the same stand-in, holding the options for ``remote``."""
        return _InjectKwargs(self._cls, self._kwargs, options, self._num_engines, self._started)

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        """Ray's ``remote``: start the actor with our engine arguments added."""
        target = self._cls.options(**self._options) if self._options is not None else self._cls
        ours = self._kwargs
        if self._num_engines is not None:
            ours = with_placement(ours, ReplicaPlacement(self._started[0], self._num_engines))
        self._started[0] += 1
        return target.remote(*args, **{ENGINE_KWARGS_ARG: ours}, **kwargs)


def with_placement(engine_kwargs: dict, placement: ReplicaPlacement) -> dict:
    """A copy of ``engine_kwargs`` whose vLLM additional_config carries ``placement``."""
    extra = dict(engine_kwargs.get("additional_config") or {})
    extra[REPLICA_CONFIG_KEY] = placement.as_dict()
    return {**engine_kwargs, "additional_config": extra}


def wrap_create_vllm_engines(vllm_engine_module: Any, engine_kwargs: dict,
                             spec: Optional[SpecConfig] = None) -> Callable[..., list]:
    """``create_vllm_engines`` of ``vllm_engine_module`` (OpenRLHF's), starting our engine actors.

    With ``spec.shared_index`` set it first creates the index coordinators for ``num_engines``
    engines in this (the launcher's) process, and places engine i as replica i.
    """
    original = vllm_engine_module.create_vllm_engines
    spec_cls = actor_subclass(SpecEngineMixin, vllm_engine_module.RolloutRayActor,
                              "SpecRolloutRayActor")
    shared = spec is not None and spec.shared_index is not None

    def create_vllm_engines(*args: Any, **kwargs: Any) -> list:
        num_engines = None
        if shared:
            from rollout_spec.distributed.sharing import ensure_coordinators

            num_engines = int(inspect.signature(original).bind(*args, **kwargs).arguments["num_engines"])
            ensure_coordinators(spec, num_engines)
        saved = vllm_engine_module.RolloutRayActor
        vllm_engine_module.RolloutRayActor = _InjectKwargs(spec_cls, engine_kwargs, num_engines=num_engines)
        try:
            return original(*args, **kwargs)
        finally:
            vllm_engine_module.RolloutRayActor = saved

    create_vllm_engines.__doc__ = original.__doc__
    return create_vllm_engines

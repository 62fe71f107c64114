"""OpenRLHF's PPO launcher with the ``--rollout_spec`` flag.

    python -m rollout_spec.integrations.openrlhf.train_ppo_ray --rollout_spec \\
        --rollout_spec.num_draft_tokens 8 <every openrlhf.cli.train_ppo_ray argument>

Our options are parsed out of the command line; when ``--rollout_spec`` is on, OpenRLHF's engine
factory and trainer class are replaced by the speculative ones (``engines.py``) and OpenRLHF's
own launcher then runs unchanged with the remaining arguments.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import inspect
import runpy
import sys
from typing import Any, Optional, Sequence

from rollout_spec.config import SpecConfig
from rollout_spec.integrations.openrlhf.options import spec_from_args, split_argv
from rollout_spec.integrations.vllm.config import engine_kwargs

OPENRLHF_LAUNCHER = "openrlhf.cli.train_ppo_ray"
TESTED_OPENRLHF = ("0.11.2",)
STEP_PARAMS = ("self", "rollout_samples", "global_step")
"""Leading parameters of OpenRLHF's ``train_step`` (Ray may append ``_ray_trace_ctx``)."""
DISPATCH_PARAMS = ("self", "prompts", "labels", "images", "generate_kwargs")
"""Parameters of ``SamplesGenerator._dispatch_prompts_to_vllm``, which the routing hook calls."""


def check_openrlhf(vllm_engine: Any, ppo_trainer: Any) -> None:
    """Raise if OpenRLHF no longer has the pieces the hooks replace or extend.

    Raises:
        RuntimeError: naming the installed version and what is missing or changed.
    """
    version = importlib.metadata.version("openrlhf")
    problems = []
    if not callable(getattr(vllm_engine, "create_vllm_engines", None)):
        problems.append("openrlhf.trainer.ray.vllm_engine.create_vllm_engines is gone")
    for name, holder in (("RolloutRayActor", vllm_engine), ("PPOTrainer", ppo_trainer)):
        if getattr(getattr(holder, name, None), "__ray_actor_class__", None) is None:
            problems.append(f"{name} is not a Ray actor class")
    step = getattr(getattr(ppo_trainer, "BasePPOTrainer", None), "train_step", None)
    if step is None or tuple(inspect.signature(step).parameters)[:3] != STEP_PARAMS:
        problems.append(f"BasePPOTrainer.train_step no longer takes {STEP_PARAMS}")
    problems += _dispatch_problems(getattr(ppo_trainer, "SamplesGenerator", None))
    if problems:
        raise RuntimeError(
            f"openrlhf {version}: " + "; ".join(problems) + f" (rollout-spec checked {TESTED_OPENRLHF})"
        )


def _dispatch_problems(generator_cls: Any) -> list[str]:
    """How OpenRLHF's prompt dispatch differs from what ``route_dispatch_by_group`` relies on."""
    dispatch = getattr(generator_cls, "_dispatch_prompts_to_vllm", None)
    if dispatch is None:
        return ["SamplesGenerator._dispatch_prompts_to_vllm is gone"]
    if tuple(inspect.signature(dispatch).parameters) != DISPATCH_PARAMS:
        return [f"SamplesGenerator._dispatch_prompts_to_vllm no longer takes {DISPATCH_PARAMS}"]
    if "self.vllm_engines" not in inspect.getsource(dispatch):
        return ["SamplesGenerator._dispatch_prompts_to_vllm no longer picks from self.vllm_engines"]
    return []


def install(spec: SpecConfig, num_speculative_tokens: Optional[int] = None) -> dict:
    """Point OpenRLHF at speculative engines and the acceptance-logging trainer; returns the
    vLLM engine arguments that every engine will get."""
    import openrlhf.trainer.ppo_trainer as ppo_trainer
    import openrlhf.trainer.ray as trainer_ray
    from openrlhf.trainer.ray import vllm_engine

    check_openrlhf(vllm_engine, ppo_trainer)

    from rollout_spec.integrations.openrlhf.engines import (
        SpecTrainerMixin,
        actor_subclass,
        wrap_create_vllm_engines,
    )

    kwargs = engine_kwargs(spec, num_speculative_tokens)
    if not getattr(trainer_ray.create_vllm_engines, "_rollout_spec", False):
        wrapped = wrap_create_vllm_engines(vllm_engine, kwargs, spec)
        wrapped._rollout_spec = True
        trainer_ray.create_vllm_engines = wrapped
        ppo_trainer.PPOTrainer = actor_subclass(
            SpecTrainerMixin, ppo_trainer.PPOTrainer, "SpecPPOTrainer"
        )
    return kwargs


def _asks_async(argv: Sequence[str]) -> bool:
    """Whether OpenRLHF's parser would read ``--train.async_enable`` from ``argv``: argparse takes
    any unambiguous prefix of it too (``--train.async_e`` on, as ``--train.async_queue_size``
    shares ``--train.async_``)."""
    flag = "--train.async_enable"
    return any(len(a) >= len("--train.async_e") and flag.startswith(a) for a in argv)


def require_openrlhf() -> None:
    """Exit with an error naming the missing package when OpenRLHF is not installed: both the
    hooks and the launcher this module runs are OpenRLHF's (else an ImportError traceback)."""
    if importlib.util.find_spec("openrlhf") is None:
        raise SystemExit(f"rollout-spec: this launcher runs {OPENRLHF_LAUNCHER}, but openrlhf is not "
                         "installed (pip install 'rollout-spec[openrlhf]')")


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Parse ``--rollout_spec*``, install the hooks, run OpenRLHF's launcher on the rest."""
    ours, rest = split_argv(sys.argv[1:] if argv is None else argv)
    try:
        parsed = spec_from_args(ours)
    except (TypeError, ValueError) as err:
        raise SystemExit(f"rollout-spec: {err}") from err
    if parsed is not None and _asks_async(rest):
        raise SystemExit(
            "rollout-spec: --rollout_spec does not support --train.async_enable yet (its "
            "generation overlaps training, so there is no single step boundary to refresh at)"
        )
    require_openrlhf()
    if parsed is not None:
        install(*parsed)
    sys.argv = [OPENRLHF_LAUNCHER, *rest]
    runpy.run_module(OPENRLHF_LAUNCHER, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

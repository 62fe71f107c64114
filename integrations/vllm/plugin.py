"""The ``vllm.general_plugins`` entry point: routes vLLM's draft step to our proposer.

vLLM loads general plugins in every process it starts (engine core, workers) before building the
model runner. ``register`` wraps ``GPUModelRunner.propose_draft_token_ids`` once: when the runner's
drafter is a ``RolloutSpecProposer`` (vLLM built it because ``speculative_config.model`` names it),
the wrapper hands it the runner, so it sees request ids, prompts and sampling params that vLLM's
plain ``custom_class`` call leaves out. It also wraps ``GPUModelRunner._update_states``, which
runs every step (the draft step does not: vLLM skips it near ``max_model_len`` and on steps
without a forward), so that finished requests are finished in the drafter then. Runners with
any other drafter run vLLM's code untouched. vLLM
instantiates ``VllmProposer``, which refuses to start if the patch is not in place. It also adds
two worker methods for ``collective_rpc``: ``rollout_spec_end_step`` (the trainer's RL step
boundary) and ``rollout_spec_stats``. This is the only file that patches vLLM.
"""
from __future__ import annotations

import functools
import inspect
import logging
import os
from typing import Any

from rollout_spec.config import parse_bool
from rollout_spec.integrations.vllm.proposer import RolloutSpecProposer

TESTED_VLLM = ("0.29.0", "0.33.0")
"""vLLM releases whose runner source this patch was checked against (OpenRLHF 0.11 pins 0.29)."""
DISABLE_ENV = "ROLLOUT_SPEC_VLLM_PLUGIN"
"""Set to 0 (or false/no/off) to keep the plugin from touching vLLM in a process."""
_EXPECTED_PARAMS = {"propose_draft_token_ids": ("self", "scheduler_output", "sampled_token_ids"),
                    "_update_states": ("self", "scheduler_output")}
_MARK = "_rollout_spec_wrapped"
logger = logging.getLogger(__name__)


_install_error: str | None = "the plugin's register() has not run in this process"
"""Why the patch is not in place here (None once it is); reported when vLLM builds our proposer."""


def register() -> None:
    """Entry point named in pyproject.toml; safe to call many times (vLLM may).

    vLLM loads every installed general plugin, also for engines that never use our proposer, so
    a failure here (a CPU/TPU build without the GPU runner, a changed vLLM) is logged and kept,
    not raised: ``VllmProposer`` raises it if and when an engine asks for our proposer. Only a
    ``ROLLOUT_SPEC_VLLM_PLUGIN`` that is not a yes/no value raises (ValueError naming it).
    """
    global _install_error
    if not parse_bool(DISABLE_ENV, os.environ.get(DISABLE_ENV, "1")):
        _install_error = f"{DISABLE_ENV}={os.environ[DISABLE_ENV]} in this process"
        return
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
        from vllm.v1.worker.gpu_worker import Worker

        install(GPUModelRunner, Worker)
    except (ImportError, RuntimeError) as err:
        _install_error = f"{type(err).__name__}: {err}"
        logger.warning("rollout-spec's vLLM plugin is not active: %s", _install_error)
        return
    _install_error = None


class VllmProposer(RolloutSpecProposer):
    """The class vLLM instantiates (``speculative_config.model`` names it): refuses to start
    when the plugin's patch is not in place, since vLLM's plain call could not serve it."""

    def __init__(self, vllm_config: Any) -> None:
        if _install_error is not None:
            raise RuntimeError(
                f"rollout-spec's vLLM plugin is not active in this process ({_install_error}); "
                "reinstall rollout-spec and, if VLLM_PLUGINS is set, add 'rollout_spec' to it"
            )
        super().__init__(vllm_config, share_index=_drafts_are_used())


def _drafts_are_used() -> bool:
    """Whether this worker's drafts reach vLLM's scheduler: the first tensor-parallel rank of the
    stage that drafts. The other ranks' drafts are dropped, so only this one shares its index."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank() == 0
    except (ImportError, AssertionError):  # no tensor-parallel group (single-process tests)
        return True


def check_runner(runner_cls: type) -> None:
    """Raise if vLLM's draft-step or state-update method no longer has the shape the wrappers
    rely on.

    Raises:
        RuntimeError: naming the vLLM version, the method and what changed.
    """
    for name, expected in _EXPECTED_PARAMS.items():
        method = getattr(runner_cls, name, None)
        if method is None:
            raise RuntimeError(f"{_vllm_version()}: GPUModelRunner.{name} is gone")
        params = tuple(inspect.signature(method).parameters)[: len(expected)]
        if params != expected and not getattr(method, _MARK, False):
            raise RuntimeError(
                f"{_vllm_version()}: GPUModelRunner.{name} starts with {params}, expected "
                f"{expected}; rollout-spec's plugin was checked on {TESTED_VLLM}"
            )


def install(runner_cls: type, worker_cls: type) -> None:
    """Wrap ``runner_cls.propose_draft_token_ids`` and ``runner_cls._update_states`` and add the
    worker RPC methods (idempotent)."""
    check_runner(runner_cls)
    original = runner_cls.propose_draft_token_ids
    if not getattr(original, _MARK, False):

        @functools.wraps(original)
        def propose_draft_token_ids(self: Any, scheduler_output: Any, sampled_token_ids: Any,
                                    *args: Any, **kwargs: Any) -> Any:
            drafter = getattr(self, "drafter", None)
            if isinstance(drafter, RolloutSpecProposer):
                return drafter.propose_for_runner(self, scheduler_output, sampled_token_ids)
            return original(self, scheduler_output, sampled_token_ids, *args, **kwargs)

        setattr(propose_draft_token_ids, _MARK, True)
        runner_cls.propose_draft_token_ids = propose_draft_token_ids
    update = runner_cls._update_states
    if not getattr(update, _MARK, False):

        @functools.wraps(update)
        def _update_states(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            drafter = getattr(self, "drafter", None)
            if isinstance(drafter, RolloutSpecProposer):
                drafter.update_states(self, scheduler_output)
            return update(self, scheduler_output, *args, **kwargs)

        setattr(_update_states, _MARK, True)
        runner_cls._update_states = _update_states
    worker_cls.rollout_spec_end_step = worker_end_step
    worker_cls.rollout_spec_stats = worker_stats


def worker_end_step(worker: Any) -> dict[str, Any]:
    """``collective_rpc("rollout_spec_end_step")``: RL step boundary on this worker's drafter."""
    proposer = _proposer_of(worker)
    return proposer.end_step() if proposer is not None else {}


def worker_stats(worker: Any) -> dict[str, Any]:
    """``collective_rpc("rollout_spec_stats")``: this worker's proposer and drafter counters."""
    proposer = _proposer_of(worker)
    return proposer.stats() if proposer is not None else {}


def _proposer_of(worker: Any) -> RolloutSpecProposer | None:
    runner = getattr(worker, "model_runner", None)
    if runner is None or not hasattr(runner, "drafter"):
        return None  # pipeline stages before the last hold no drafter
    if not isinstance(runner.drafter, RolloutSpecProposer):
        raise RuntimeError(
            "this vLLM engine drafts with "
            f"{type(runner.drafter).__name__}, not rollout-spec's proposer; build it with "
            "rollout_spec.integrations.vllm.engine_kwargs(...)"
        )
    return runner.drafter


def _vllm_version() -> str:
    try:
        import vllm

        return f"vllm {vllm.__version__}"
    except ImportError:
        return "vllm (not importable)"

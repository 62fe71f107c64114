"""verl's vLLM server and replica, drafting with rollout-spec's vLLM proposer when the flag is on.

Like ``sglang_server.py``: subclasses of verl's own, identical to them with the flag unset.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import ray
from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica

from rollout_spec.integrations.verl import capture, metrics
from rollout_spec.integrations.verl.config import spec_from_rollout_config
from rollout_spec.integrations.verl.engine_args import install_engine_kwargs
from rollout_spec.integrations.verl.replicas import ScaleOutReplicaMixin, server_placement
from rollout_spec.integrations.vllm.config import GROUP_ID_EXTRA_ARG
from rollout_spec.prompt_roots import PromptRoots

if TYPE_CHECKING:  # verl's return type of generate, for annotations only
    from verl.workers.rollout.replica import TokenOutput


class RolloutSpecvLLMHttpServer(vLLMHttpServer):
    """vLLMHttpServer that drafts with rollout-spec's vLLM proposer and reports verl's spec counters.

    Each request names its group in ``extra_args``: that of the sample's first prompt, which a
    later turn or a resumed tail extends (``PromptRoots``). The proposer keeps such a registry
    too, but per engine: with data-parallel engines a sample's later call may reach another one.
    """

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self._spec = spec_from_rollout_config(self.config)
        self._spec_stats: dict[str, Any] = {}
        self._spec_weights_step: Any = None
        self._prompt_roots = PromptRoots()

    async def launch_server(self, *args: Any, **kwargs: Any) -> None:
        """Launch vLLM with our proposer as its speculative method (and this replica's placement
        when the drafters share their index, which needs one data-parallel engine per replica)."""
        if self._spec is not None:
            placement = server_placement(self.config, self._spec, self.replica_rank)
            dp = getattr(self.config, "data_parallel_size", 1)
            if placement is not None and dp > 1:
                raise ValueError(
                    "custom.rollout_spec.shared_index needs data_parallel_size=1 with vLLM, got "
                    f"{dp}: each data-parallel engine drafts with its own index, and all would publish "
                    "as this one replica, so none would learn the others' samples of its groups")
            install_engine_kwargs(self.config, self._spec, "vllm", placement)
        await super().launch_server(*args, **kwargs)
        if self._spec is not None and getattr(self, "engine", None) is not None:
            capture.record_vllm_stats(self.engine, self._spec_stats)

    async def set_global_steps(self, global_steps: int) -> None:
        """verl calls this right after new weights reach the engine: the RL step boundary, where
        the drafters age their history (and publish to the shared index). Once per step."""
        if self._spec is not None and getattr(self, "engine", None) is not None \
                and global_steps != self._spec_weights_step:
            self._spec_weights_step = global_steps
            await self.engine.collective_rpc("rollout_spec_end_step")
        await super().set_global_steps(global_steps)

    async def generate(self, prompt_ids: Any, sampling_params: dict[str, Any], request_id: str, *args: Any,
                       **kwargs: Any) -> TokenOutput:
        """verl's generate with the group of the sample's first prompt in the sampling parameters
        and the three counters in extra_fields."""
        if self._spec is None:
            return await super().generate(prompt_ids, sampling_params, request_id, *args, **kwargs)
        sampling_params = sampling_params_with_group(sampling_params,
                                                     self._prompt_roots.group_of(list(prompt_ids)))
        try:
            out = await super().generate(prompt_ids, sampling_params, request_id, *args, **kwargs)
            out.extra_fields.update(metrics.from_vllm_stats(self._spec_stats.get(request_id),
                                                            response_tokens=len(out.token_ids)))
            return out
        finally:
            self._spec_stats.pop(request_id, None)


def sampling_params_with_group(sampling_params: dict, group_id: int) -> dict:
    """A copy of verl's ``sampling_params`` (vLLM's ``SamplingParams`` keywords) whose
    ``extra_args`` names ``group_id`` as the request's group for our proposer.

    The caller's dict and its ``extra_args`` are not touched (verl reuses them across turns and
    its server pops keys from the dict it gets); the caller's other ``extra_args`` are kept, and
    a group the caller named there itself wins.
    """
    extra_args = dict(sampling_params.get("extra_args") or {})
    extra_args.setdefault(GROUP_ID_EXTRA_ARG, group_id)
    return {**sampling_params, "extra_args": extra_args}


class RolloutSpecvLLMReplica(ScaleOutReplicaMixin, vLLMReplica):
    """vLLMReplica that starts our server class when the flag is on (validated here, early), routes
    group-sticky and creates the shared-index coordinators (``replicas.py``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if spec_from_rollout_config(self.config) is not None:
            self.server_class = ray.remote(RolloutSpecvLLMHttpServer)

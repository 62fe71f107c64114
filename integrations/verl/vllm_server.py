"""verl's vLLM server and replica, drafting with rollout-spec's vLLM proposer when the flag is on.

Like ``sglang_server.py``: subclasses of verl's own, identical to them with the flag unset.
"""
from __future__ import annotations

from typing import Any

import ray
from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica

from rollout_spec.integrations.verl import capture, metrics
from rollout_spec.integrations.verl.config import spec_from_rollout_config
from rollout_spec.integrations.verl.engine_args import install_engine_kwargs
from rollout_spec.integrations.verl.replicas import ScaleOutReplicaMixin, server_placement


class RolloutSpecvLLMHttpServer(vLLMHttpServer):
    """vLLMHttpServer that drafts with rollout-spec's vLLM proposer and reports verl's spec counters."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self._spec = spec_from_rollout_config(self.config)
        self._spec_stats: dict[str, Any] = {}
        self._spec_weights_step: Any = None

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

    async def generate(self, prompt_ids: Any, sampling_params: dict, request_id: str, *args: Any, **kwargs: Any):
        """verl's generate with the three counters in extra_fields."""
        if self._spec is None:
            return await super().generate(prompt_ids, sampling_params, request_id, *args, **kwargs)
        try:
            out = await super().generate(prompt_ids, sampling_params, request_id, *args, **kwargs)
            out.extra_fields.update(metrics.from_vllm_stats(self._spec_stats.get(request_id),
                                                            response_tokens=len(out.token_ids)))
            return out
        finally:
            self._spec_stats.pop(request_id, None)


class RolloutSpecvLLMReplica(ScaleOutReplicaMixin, vLLMReplica):
    """vLLMReplica that starts our server class when the flag is on (validated here, early), routes
    group-sticky and creates the shared-index coordinators (``replicas.py``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if spec_from_rollout_config(self.config) is not None:
            from rollout_spec.integrations.vllm.config import PROPOSER_CLASS_PATH  # noqa: F401  (presence check)

            self.server_class = ray.remote(RolloutSpecvLLMHttpServer)

"""verl's SGLang server and replica, drafting with rollout-spec when the flag is on.

Each class subclasses verl's own and, with ``actor_rollout_ref.rollout.custom.speculative``
unset, behaves exactly like it. Importing this imports verl's SGLang server module, so only the
loader that ``plugin.py`` registers imports it (after verl's own loader prepared the imports).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import ray
from verl.workers.rollout.sglang_rollout.async_sglang_server import SGLangHttpServer, SGLangReplica

from rollout_spec.integrations.sglang.config import spec_to_env
from rollout_spec.integrations.sglang.rid import rid_with_group_id
from rollout_spec.integrations.verl import capture, metrics
from rollout_spec.integrations.verl.config import spec_from_rollout_config
from rollout_spec.integrations.verl.engine_args import install_engine_kwargs
from rollout_spec.integrations.verl.replicas import ScaleOutReplicaMixin, server_placement
from rollout_spec.prompt_roots import PromptRoots

if TYPE_CHECKING:  # verl's return type of generate, for annotations only
    from verl.workers.rollout.replica import TokenOutput


class RolloutSpecSGLangHttpServer(SGLangHttpServer):
    """SGLangHttpServer whose NGRAM worker drafts with our corpus, reporting verl's spec counters.

    The SpecConfig goes to SGLang's scheduler processes in ``ROLLOUT_SPEC_SGLANG`` (read by our
    SGLang plugin); request ids carry the group of the sample's first prompt (a later turn or a
    resumed tail extends it: ``PromptRoots``); ``meta_info`` counters are kept.
    """

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self._spec = spec_from_rollout_config(self.config)
        self._spec_meta: dict[str, dict] = {}
        self._prompt_roots = PromptRoots()

    async def launch_server(self, *args: Any, **kwargs: Any) -> None:
        """Launch SGLang with the NGRAM worker and our plugin's variables set (the scheduler
        processes inherit them, the replica placement included when the index is shared)."""
        if self._spec is not None:
            placement = server_placement(self.config, self._spec, self.replica_rank)
            if placement is not None:
                # verl launches SGLang with tp_size = tensor_model_parallel_size * data_parallel_size
                tp, dp = self.config.tensor_model_parallel_size, self.config.data_parallel_size
                if tp * dp > 1:
                    raise ValueError("custom.rollout_spec.shared_index needs tensor_model_parallel_size=1 and "
                                     f"data_parallel_size=1 with SGLang (verl's SGLang tp_size is their product), "
                                     f"got {tp} x {dp}: every rank drafts on its own")
                placement.to_env()
            spec_to_env(self._spec)
            install_engine_kwargs(self.config, self._spec, "sglang")
        await super().launch_server(*args, **kwargs)
        if self._spec is not None and getattr(self, "tokenizer_manager", None) is not None:
            capture.record_sglang_meta(self.tokenizer_manager, self._spec_meta)

    async def generate(self, prompt_ids: Any, sampling_params: dict[str, Any], request_id: str, *args: Any,
                       **kwargs: Any) -> TokenOutput:
        """verl's generate with a request id tagged with the group of the sample's first prompt
        and the three counters in extra_fields."""
        if self._spec is None:
            return await super().generate(prompt_ids, sampling_params, request_id, *args, **kwargs)
        rid = rid_with_group_id(request_id, self._prompt_roots.group_of(list(prompt_ids)))
        try:
            out = await super().generate(prompt_ids, sampling_params, rid, *args, **kwargs)
            out.extra_fields.update(metrics.from_sglang_meta(self._spec_meta.get(rid, {})))
            return out
        finally:
            self._spec_meta.pop(rid, None)


class RolloutSpecSGLangReplica(ScaleOutReplicaMixin, SGLangReplica):
    """SGLangReplica that starts our server class when the flag is on (validated here, early),
    routes group-sticky and creates the shared-index coordinators (``replicas.py``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if spec_from_rollout_config(self.config) is not None:
            self.server_class = ray.remote(RolloutSpecSGLangHttpServer)

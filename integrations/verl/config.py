"""Read the rollout-spec flag from verl's rollout config and turn it into engine arguments.

verl's ``RolloutConfig`` is a closed dataclass whose extension point is the free-form
``custom`` dict, so the flag is ``actor_rollout_ref.rollout.custom.speculative=rollout_spec``
and our options are ``actor_rollout_ref.rollout.custom.rollout_spec.<SpecConfig field>``.
Nothing here imports verl.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from rollout_spec.config import SpecConfig
from rollout_spec.distributed.placement import ReplicaPlacement
from rollout_spec.integrations.vllm.config import spec_from_dict

FLAG_PATH = "actor_rollout_ref.rollout.custom.speculative"
FLAG_VALUE = "rollout_spec"
OPTIONS_PATH = "actor_rollout_ref.rollout.custom.rollout_spec"
BACKENDS = ("sglang", "vllm")


def _get(obj: Any, key: str, default: Any = None) -> Any:
    """Field of a dataclass, DictConfig or dict alike."""
    if isinstance(obj, Mapping) or hasattr(obj, "get"):
        return obj.get(key, default)
    return getattr(obj, key, default)


def _plain(value: Any) -> Any:
    """OmegaConf containers to plain Python, without importing OmegaConf."""
    if hasattr(value, "items"):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig":
        return [_plain(v) for v in value]
    return value


def spec_from_rollout_config(rollout: Any) -> Optional[SpecConfig]:
    """The validated SpecConfig when the flag is on, None when it is off.

    Raises:
        ValueError: the flag has another value, an option is unknown or out of range, the
            options set num_draft_tokens 0, the backend is not sglang/vllm, or the config also
            enables verl's MTP rollout or PD disaggregation (both change the speculative path
            this hook owns).
        TypeError: ``custom``, its options or an option's value has the wrong type.
    """
    custom = _plain(_get(rollout, "custom"))
    custom = {} if custom is None else custom
    if not isinstance(custom, Mapping):
        raise TypeError(f"actor_rollout_ref.rollout.custom must be a dict, got {type(custom).__name__}")
    flag = custom.get("speculative")
    if flag is None:
        if "rollout_spec" in custom:
            raise ValueError(f"{OPTIONS_PATH} is set but {FLAG_PATH} is not; set {FLAG_PATH}={FLAG_VALUE}")
        return None
    if flag != FLAG_VALUE:
        raise ValueError(f"{FLAG_PATH} must be {FLAG_VALUE!r} or unset, got {flag!r}")
    name = _get(rollout, "name")
    if name not in BACKENDS:
        raise ValueError(f"actor_rollout_ref.rollout.name must be one of {BACKENDS} with {FLAG_PATH}, got {name!r}")
    mtp = _get(rollout, "mtp")
    if mtp is not None and _get(mtp, "enable") and _get(mtp, "enable_rollout"):
        raise ValueError(f"{FLAG_PATH}={FLAG_VALUE} cannot be combined with actor_rollout_ref.rollout.mtp.enable_rollout")
    pd = _get(rollout, "disaggregation")
    if pd is not None and _get(pd, "enabled"):
        raise ValueError(f"{FLAG_PATH}={FLAG_VALUE} does not support actor_rollout_ref.rollout.disaggregation yet")
    options = custom.get("rollout_spec")
    spec = spec_from_dict({} if options is None else options, source=OPTIONS_PATH)
    if spec.num_draft_tokens == 0:
        raise ValueError(f"{OPTIONS_PATH}.num_draft_tokens is 0 (speculation off): unset {FLAG_PATH} instead")
    return spec


def merged_engine_kwargs(user: Optional[Mapping[str, Any]], ours: Mapping[str, Any], backend: str) -> dict[str, Any]:
    """``ours`` added to the user's ``engine_kwargs.<backend>``; a key set differently by both is an error.

    Raises:
        ValueError: naming the conflicting ``actor_rollout_ref.rollout.engine_kwargs`` key.
        TypeError: the user's ``engine_kwargs.<backend>`` is not a dict.
    """
    user = _plain(user)
    if user is not None and not isinstance(user, Mapping):
        raise TypeError(f"actor_rollout_ref.rollout.engine_kwargs.{backend} must be a dict, got {type(user).__name__}")
    merged = dict(user or {})
    for key, value in ours.items():
        if key in merged and merged[key] is not None and merged[key] != value:
            raise ValueError(
                f"actor_rollout_ref.rollout.engine_kwargs.{backend}.{key}={merged[key]!r} conflicts with "
                f"{FLAG_PATH}={FLAG_VALUE}, which sets it to {value!r}; remove it"
            )
        merged[key] = value
    return merged


def backend_engine_kwargs(spec: SpecConfig, backend: str, placement: Optional[ReplicaPlacement] = None) -> dict[str, Any]:
    """Engine arguments that make ``backend`` draft with rollout-spec.

    SGLang: the NGRAM worker sized for ``spec`` (our corpus replaces its trie through the SGLang
    plugin; its placement travels in the environment). vLLM: the custom proposer of
    ``rollout_spec.integrations.vllm``, with ``placement`` in its additional_config, and the
    per-request acceptance counters that verl's metrics read.
    """
    if backend == "sglang":
        from rollout_spec.integrations.sglang.config import server_args

        return server_args(spec)
    if backend == "vllm":
        from rollout_spec.integrations.vllm.config import engine_kwargs

        # per-request counters on each output, for verl's rollout/spec_* metrics (metrics.py)
        return {**engine_kwargs(spec, placement=placement), "per_request_spec_decode_metrics": "summary"}
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")

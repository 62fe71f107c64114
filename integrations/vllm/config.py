"""Translate a rollout-spec ``SpecConfig`` into vLLM engine arguments and back.

vLLM picks a speculative proposer from ``speculative_config``; an out-of-tree proposer is named by
its dotted class path (vLLM's ``custom_class`` method). Our drafter's own options travel in
``additional_config["rollout_spec"]``, which vLLM hands unchanged to every worker process. Nothing
here imports vLLM, so the translation is testable without it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from rollout_spec.config import SpecConfig, check_int
from rollout_spec.distributed.placement import ReplicaPlacement

PROPOSER_CLASS_PATH = "rollout_spec.integrations.vllm.plugin.VllmProposer"
"""What vLLM's ``speculative_config.model`` must name for vLLM to build our proposer."""
ADDITIONAL_CONFIG_KEY = "rollout_spec"
"""Key of our options inside vLLM's ``additional_config`` dict."""
REPLICA_CONFIG_KEY = "rollout_spec_replica"
"""Key of this engine's ``ReplicaPlacement`` inside ``additional_config`` (the shared index)."""
GROUP_ID_EXTRA_ARG = "rollout_spec_group"
"""``SamplingParams.extra_args`` key naming a request's group (its prompt) explicitly."""


def default_num_speculative_tokens(spec: SpecConfig) -> int:
    """Chain length vLLM verifies when none is given: the drafter's per-request node budget,
    bounded by its tree depth (vLLM verifies one root-to-leaf path, never a whole tree)."""
    return max(1, min(spec.num_draft_tokens, spec.max_depth))


def speculative_config(spec: SpecConfig, num_speculative_tokens: int | None = None) -> dict:
    """The ``speculative_config`` dict that makes vLLM draft with our proposer.

    Raises:
        ValueError: ``spec.num_draft_tokens`` is 0 (speculation off: pass no speculative_config),
            or ``num_speculative_tokens`` is outside [1, 1024].
    """
    if spec.num_draft_tokens == 0:
        raise ValueError(
            "SpecConfig.num_draft_tokens is 0 (speculation disabled); build the engine without "
            "a speculative_config instead"
        )
    k = default_num_speculative_tokens(spec) if num_speculative_tokens is None else (
        check_int("num_speculative_tokens", num_speculative_tokens, 1, 1024)
    )
    return {"method": "custom_class", "model": PROPOSER_CLASS_PATH, "num_speculative_tokens": k}


def spec_to_dict(spec: SpecConfig) -> dict[str, Any]:
    """Plain, JSON-able form of ``spec`` (tuples become lists) for vLLM's additional_config."""
    out = dataclasses.asdict(spec)
    out["external_corpora"] = list(spec.external_corpora)
    return out


def spec_from_dict(options: Any, source: str = f"additional_config[{ADDITIONAL_CONFIG_KEY!r}]") -> SpecConfig:
    """Rebuild a validated ``SpecConfig`` from ``spec_to_dict`` output or hand-written options.

    ``source`` names where the options came from (vLLM's additional_config by default; an
    environment variable or a framework's config path otherwise); every error starts with it.

    Raises:
        TypeError / ValueError: not a dict, an unknown key (named, with the known ones) or a bad
            value (``SpecConfig`` names the field and its range).
    """
    if not isinstance(options, Mapping):
        raise TypeError(f"{source} must be a dict of SpecConfig fields, got {type(options).__name__}")
    known = {f.name for f in dataclasses.fields(SpecConfig)}
    unknown = sorted(map(repr, set(options) - known))
    if unknown:
        raise ValueError(f"{source} has unknown key(s) [{', '.join(unknown)}]; allowed: {sorted(known)}")
    try:
        return SpecConfig(**options)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{source}: {exc}") from None


def engine_kwargs(
    spec: SpecConfig, num_speculative_tokens: int | None = None, placement: ReplicaPlacement | None = None
) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM``/``vllm.EngineArgs``/``AsyncEngineArgs``.

    ``disable_log_stats=False`` keeps vLLM's spec-decode counters (drafts, drafted and accepted
    tokens) flowing into its metrics, which is where acceptance is read from. ``placement`` (this
    engine's replica rank and the replica count) is what ``spec.shared_index`` needs.
    """
    extra: dict[str, Any] = {ADDITIONAL_CONFIG_KEY: spec_to_dict(spec)}
    if placement is not None:
        extra[REPLICA_CONFIG_KEY] = placement.as_dict()
    return {
        "speculative_config": speculative_config(spec, num_speculative_tokens),
        "additional_config": extra,
        "disable_log_stats": False,
    }


def _additional_config(vllm_config: Any) -> Mapping:
    """The engine's ``additional_config`` (empty when none was passed); TypeError unless a dict
    (an empty string, 0 or False too: they are no dict, not "no options")."""
    extra = getattr(vllm_config, "additional_config", None)
    if extra is None:
        return {}
    if not isinstance(extra, Mapping):
        raise TypeError(f"vLLM additional_config must be a dict, got {type(extra).__name__}")
    return extra


def placement_from_vllm_config(vllm_config: Any) -> ReplicaPlacement | None:
    """The replica placement an engine was built with (None: not given)."""
    value = _additional_config(vllm_config).get(REPLICA_CONFIG_KEY)
    return None if value is None else ReplicaPlacement.from_dict(value)


def spec_from_vllm_config(vllm_config: Any) -> SpecConfig:
    """The ``SpecConfig`` a vLLM engine was built with (defaults when none was passed)."""
    extra = _additional_config(vllm_config)
    return spec_from_dict(extra.get(ADDITIONAL_CONFIG_KEY, {}))

"""rollout-spec: model-free speculative decoding for RL rollouts.

The heavy parts (the engine and torch) are imported on first use, so ``import rollout_spec``
stays cheap for adapters that only need the drafter. So is the C++ core (``DraftBatch``): the
framework plugins' entry points (e.g. SGLang's, imported in every scheduler) must import without
it, so that they decide themselves how a core that fails to load is reported.
"""
from __future__ import annotations

from rollout_spec.config import SamplingParams, SpecConfig
from rollout_spec.lazy_imports import lazy_attributes

__version__ = "0.1.0"

_LAZY = {
    "DraftBatch": "rollout_spec.tree",
    "NgramDrafter": "rollout_spec.drafter",
    "RolloutEngine": "rollout_spec.engine",
    "RolloutOutput": "rollout_spec.rollout",
    "RolloutSession": "rollout_spec.rollout",
}

__all__ = ["SamplingParams", "SpecConfig", *_LAZY]

__getattr__ = lazy_attributes(__name__, _LAZY)

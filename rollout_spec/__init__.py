"""rollout-spec: model-free speculative decoding for RL rollouts.

The heavy parts (the engine and torch) are imported on first use, so ``import rollout_spec``
stays cheap for adapters that only need the drafter.
"""
from __future__ import annotations

from rollout_spec.config import SamplingParams, SpecConfig
from rollout_spec.lazy_imports import lazy_attributes
from rollout_spec.tree import DraftBatch

__version__ = "0.1.0"

_LAZY = {
    "NgramDrafter": "rollout_spec.drafter",
    "RolloutEngine": "rollout_spec.engine",
    "RolloutOutput": "rollout_spec.rollout",
    "RolloutSession": "rollout_spec.rollout",
}

__all__ = ["DraftBatch", "SamplingParams", "SpecConfig", *_LAZY]

__getattr__ = lazy_attributes(__name__, _LAZY)

"""The embedded rollout engine (model, static KV cache, scheduler, runner, speculative loop).

``RolloutEngine`` is imported on first use so that loading the model code alone stays light.
"""
from __future__ import annotations

from rollout_spec.lazy_imports import lazy_attributes

_LAZY = {"RolloutEngine": "rollout_spec.engine.engine"}

__all__ = [*_LAZY]

__getattr__ = lazy_attributes(__name__, _LAZY)

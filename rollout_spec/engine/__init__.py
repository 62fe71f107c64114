"""The embedded rollout engine (model, static KV cache, scheduler, runner, speculative loop).

``RolloutEngine`` is imported on first use so that loading the model code alone stays light.
"""
from __future__ import annotations

from typing import Any

__all__ = ["RolloutEngine"]


def __getattr__(name: str) -> Any:
    if name == "RolloutEngine":
        from rollout_spec.engine.engine import RolloutEngine

        return RolloutEngine
    raise AttributeError(f"module 'rollout_spec.engine' has no attribute {name!r}")

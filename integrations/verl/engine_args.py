"""Shared by the verl server subclasses: putting our engine arguments into verl's rollout config."""
from __future__ import annotations

from typing import Any, Optional

from rollout_spec.config import SpecConfig
from rollout_spec.distributed.placement import ReplicaPlacement
from rollout_spec.integrations.verl.config import backend_engine_kwargs, merged_engine_kwargs


def install_engine_kwargs(
    rollout_config: Any, spec: SpecConfig, backend: str, placement: Optional[ReplicaPlacement] = None
) -> None:
    """Add ``spec``'s arguments for ``backend`` to ``rollout_config.engine_kwargs[backend]``.

    verl's server reads them from there when it launches the engine (``engine_kwargs`` is one of
    RolloutConfig's mutable fields). Raises ValueError on a conflicting user setting.
    """
    kwargs = dict(rollout_config.engine_kwargs or {})
    ours = backend_engine_kwargs(spec, backend, placement)
    kwargs[backend] = merged_engine_kwargs(kwargs.get(backend), ours, backend)
    rollout_config.engine_kwargs = kwargs

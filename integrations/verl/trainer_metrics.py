"""verl's default (v1) trainer logs ``rollout/spec_accept_rate`` and ``rollout/spec_accept_length``
for our rollouts too.

verl 0.9.1's v1 ``PPOTrainer._compute_metrics`` (``python -m verl.trainer.main_ppo``, whose
``trainer.use_v1`` is on by default) fetches the per-request ``spec_*`` counters from its transfer
queue only when the MTP rollout is on, which the flag refuses, so the counters our servers fill
were dropped. The wrapper fetches them the same way when the flag is on and hands them to verl's
own ``compute_spec_decode_metrics``. The v0 trainer (``main_ppo_v0``) reads them unconditionally.
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Optional

import numpy as np

from rollout_spec.integrations.verl.config import spec_from_rollout_config
from rollout_spec.integrations.verl.metrics import SPEC_FIELDS

V1_TRAINER_MODULE = "verl.trainer.ppo.v1.trainer_base"


def install() -> bool:
    """Wrap the v1 ``PPOTrainer._compute_metrics`` of this process, if its module is loaded here
    (the trainer's process: it looks up the replica class, and so calls this, while it builds
    its servers); True if wrapped now. Idempotent."""
    module = sys.modules.get(V1_TRAINER_MODULE)
    trainer = getattr(module, "PPOTrainer", None)
    if trainer is None or getattr(trainer._compute_metrics, "rollout_spec_wrapped", False):
        return False
    trainer._compute_metrics = _wrap(trainer._compute_metrics, module)
    return True


def _wrap(original: Callable[..., Any], module: Any) -> Callable[..., Any]:
    @functools.wraps(original)
    def _compute_metrics(self: Any, batch: Any, metrics: dict, *args: Any, **kwargs: Any) -> Any:
        counters = spec_counters(self.config, batch, module.tq.kv_batch_get)
        result = original(self, batch, metrics, *args, **kwargs)
        if counters is not None:
            metrics.update(module.compute_spec_decode_metrics(*counters, non_padding_mask(batch)))
        return result

    _compute_metrics.rollout_spec_wrapped = True  # type: ignore[attr-defined]
    return _compute_metrics


def spec_counters(config: Any, batch: Any, kv_batch_get: Callable[..., Any]) -> Optional[tuple[list, list, list]]:
    """The batch's per-request (drafted, accepted, verify steps), as verl's MTP branch reads them,
    when our flag is on and verl does not read them itself; None otherwise, or when a sample lacks
    them (verl's rule: all or none)."""
    if spec_from_rollout_config(config.actor_rollout_ref.rollout) is None:
        return None
    mtp = getattr(config.actor_rollout_ref.model, "mtp", None)
    if mtp is not None and mtp.enable and mtp.enable_rollout:
        return None  # verl's own branch reads them (the flag refuses this case at build time)
    data = kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["extra_fields"])
    extra = data.pop("extra_fields").tolist()
    if not extra or not all(isinstance(e, dict) and all(k in e for k in SPEC_FIELDS) for e in extra):
        return None
    drafted, accepted, verified = ([e[k] for e in extra] for k in SPEC_FIELDS)
    return drafted, accepted, verified


def non_padding_mask(batch: Any) -> np.ndarray:
    """verl's mask of the batch's real samples (padding rows are tagged ``is_padding``)."""
    return np.array([not tag.get("is_padding", False) for tag in batch.tags], dtype=bool)

"""A drafter state the checkpoint tests share: three RL steps of 16 requests in 4 groups, the
first two finished and aged past a small capacity (so an index was evicted and rebuilt), the
third live (ids 32-47)."""
from __future__ import annotations

import numpy as np

from rollout_spec.config import SpecConfig
from rollout_spec.drafter import NgramDrafter

LIVE_IDS = list(range(32, 48))


def evicted_drafter() -> NgramDrafter:
    """The state above, from seeded random tokens; the same every call."""
    rng = np.random.default_rng(0)
    d = NgramDrafter(SpecConfig(capacity_tokens=1024))
    for step in range(3):
        ids = list(range(step * 16, step * 16 + 16))
        d.start_batch(ids, [rng.integers(0, 20, 12) for _ in ids], [i % 4 for i in ids])
        for _ in range(10):
            d.extend_batch(ids, [rng.integers(0, 20, rng.integers(1, 4)) for _ in ids])
        if step < 2:
            d.finish_batch(ids)
            d.end_step()
    return d

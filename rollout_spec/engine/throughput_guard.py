"""A measured check on the budget's decision to draft: seconds per emitted token, per batch size.

The budget predicts a drafting step's throughput from a GPU grid, an acceptance estimate and a
learned host residual. When any of them is off (acceptance that dropped with the temperature, a
drafter whose cost the residual model spreads over the wrong feature), it keeps drafting at a
loss. ``ThroughputGuard`` keeps what actually happened: for each half-octave of the batch size,
an exponential average of wall seconds per emitted token on plain steps and on drafting steps.
Where both are known and drafting's is worse, it vetoes drafting; the budget's periodic probes
keep the drafting figure fresh, so the veto lifts when drafting starts to pay again.
"""
from __future__ import annotations

import math

from rollout_spec.config import check_float, check_int


class ThroughputGuard:
    """Measured seconds per token of the plain and the drafting path, per batch bucket.

    ``decay`` is the weight of each new step in its bucket's average; a bucket judges only after
    ``min_steps`` steps of each path; drafting is vetoed when its seconds per token exceed the
    plain path's by more than ``margin`` (a fraction).
    """

    def __init__(self, decay: float = 0.1, min_steps: int = 4, margin: float = 0.0) -> None:
        self.decay = check_float("decay", decay, 1e-6, 1.0)
        self.min_steps = check_int("min_steps", min_steps, 1, 1 << 20)
        self.margin = check_float("margin", margin, 0.0, 10.0)
        self._avg: dict[tuple[bool, int], float] = {}
        self._count: dict[tuple[bool, int], int] = {}

    @staticmethod
    def _bucket(batch: int) -> int:
        return int(round(2 * math.log2(batch)))

    def observe(self, drafted: bool, batch: int, tokens: int, seconds: float) -> None:
        """Record one decode step: its path, batch size, tokens emitted and wall seconds."""
        check_int("batch", batch, 1, 1 << 20)
        check_int("tokens", tokens, 1, 1 << 40)
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"seconds must be finite and >= 0, got {seconds}")
        key = (drafted, self._bucket(batch))
        per_token = seconds / tokens
        old = self._avg.get(key)
        if old is None:
            self._avg[key] = per_token
        else:  # capped: a one-off stall (a kernel compiling) must not veto drafting for long
            self._avg[key] = old + self.decay * (min(per_token, 3.0 * old) - old)
        self._count[key] = self._count.get(key, 0) + 1

    def seconds_per_token(self, drafted: bool, batch: int) -> float | None:
        """The bucket's average, or None before ``min_steps`` steps of that path."""
        key = (drafted, self._bucket(batch))
        return self._avg[key] if self._count.get(key, 0) >= self.min_steps else None

    def wants_plain(self, batch: int) -> bool:
        """True while this bucket has had fewer than ``min_steps`` plain steps."""
        return self._count.get((False, self._bucket(batch)), 0) < self.min_steps

    def allows_drafting(self, batch: int) -> bool:
        """False where both paths were measured and drafting emitted tokens more slowly."""
        plain, drafting = self.seconds_per_token(False, batch), self.seconds_per_token(True, batch)
        return plain is None or drafting is None or drafting <= plain * (1.0 + self.margin)

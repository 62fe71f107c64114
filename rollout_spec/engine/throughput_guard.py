"""A measured check on the budget's decision to draft: seconds per emitted token, per batch size.

The budget predicts a drafting step's throughput from a GPU grid, an acceptance estimate and a
learned host residual. When any of them is off (acceptance that dropped with the temperature, a
drafter whose cost the residual model spreads over the wrong feature), it keeps drafting at a
loss. ``ThroughputGuard`` keeps what actually happened: for each half-octave of the batch size,
exponential averages of wall seconds and of emitted tokens per step, on plain steps and on
drafting steps, whose ratio is the path's seconds per token. (An average of each step's own
seconds per token overrates a path whose steps emit unevenly many tokens: at B=1 a drafting
step emits 1 to 9, and steps of 1 and 3 tokens read as 0.67 s per token where 0.5 is true.)
Where both are known and drafting's is not better by ``min_gain``, it vetoes drafting; the
budget's periodic probes keep the drafting figure fresh, so the veto lifts when drafting is
better by twice ``min_gain`` (hysteresis: at T=1.0 one lucky probe lifted a veto that was right,
and the drafting steps after it lost until the average caught up). While drafting is allowed, the guard asks for a plain step every
``refresh_every`` drafting steps of a bucket: steps slow down as contexts grow, so a plain
figure from the start of a rollout would flatter or condemn drafting later on (measured on the
H100: with the plain figure taken once, B=64 at T=1.0 drafted 96% of its steps at an 8% loss).
A plain figure needs refreshing only as often as its drift could change the verdict, so the
gap grows with drafting's measured lead: ``refresh_every`` up to a lead of ``refresh_lead``,
in proportion beyond it, at most ``MAX_REFRESH_STRETCH`` times. Where drafting emits tokens
twice as fast (B=8, T=0.6 on the H100), a plain step every 32 drafting steps was 3% of the
steps at half the rate, about 1.3% of the throughput.
"""
from __future__ import annotations

import math

from rollout_spec.config import check_float, check_int
from rollout_spec.engine.step_cost import batch_bucket

MAX_REFRESH_STRETCH = 8  # the plain figure is refreshed at least every 8 * refresh_every steps


class ThroughputGuard:
    """Measured seconds per token of the plain and the drafting path, per batch bucket.

    ``decay`` is the weight of each new step in its bucket's average; a bucket judges only after
    ``min_steps`` steps of each path; drafting is vetoed unless it emits tokens at least
    ``min_gain`` (a fraction) faster than the plain path; ``refresh_every`` drafting steps of a
    bucket without a plain one make it ask for a plain step (``wants_plain``), or more where
    drafting leads by more than ``refresh_lead`` (a fraction; see ``refresh_gap``).
    """

    def __init__(self, decay: float = 0.1, min_steps: int = 4, min_gain: float = 0.0,
                 refresh_every: int = 32, refresh_lead: float = 0.2) -> None:
        self.decay = check_float("decay", decay, 1e-6, 1.0)
        self.min_steps = check_int("min_steps", min_steps, 1, 1 << 20)
        self.min_gain = check_float("min_gain", min_gain, 0.0, 10.0)
        self.refresh_every = check_int("refresh_every", refresh_every, 1, 1 << 20)
        self.refresh_lead = check_float("refresh_lead", refresh_lead, 1e-6, 100.0)
        self._avg: dict[tuple[bool, int], tuple[float, float]] = {}  # (seconds, tokens) per step
        self._count: dict[tuple[bool, int], int] = {}
        self._since_plain: dict[int, int] = {}  # drafting steps per bucket since its last plain one
        self._vetoed: set[int] = set()  # buckets where drafting is vetoed until it clearly pays

    def observe(self, drafted: bool, batch: int, tokens: int, seconds: float) -> None:
        """Record one decode step: its path, batch size, tokens emitted and wall seconds."""
        check_int("batch", batch, 1, 1 << 20)
        check_int("tokens", tokens, 1, 1 << 40)
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"seconds must be finite and >= 0, got {seconds}")
        bucket = batch_bucket(batch)
        self._since_plain[bucket] = self._since_plain.get(bucket, 0) + 1 if drafted else 0
        key = (drafted, bucket)
        old = self._avg.get(key)
        if old is None or old[0] <= 0.0:  # a first step timed at 0 (a coarse clock) is no base:
            self._avg[key] = (seconds, float(tokens))  # the 3x cap would hold the average at 0
        else:  # capped: a one-off stall (a kernel compiling) must not veto drafting for long
            secs, toks = old
            self._avg[key] = (secs + self.decay * (min(seconds, 3.0 * secs) - secs),
                              toks + self.decay * (tokens - toks))
        self._count[key] = self._count.get(key, 0) + 1

    def seconds_per_token(self, drafted: bool, batch: int) -> float | None:
        """The bucket's average, or None before ``min_steps`` steps of that path."""
        return self._per_token(drafted, batch_bucket(batch))

    def _per_token(self, drafted: bool, bucket: int) -> float | None:
        """``seconds_per_token`` by bucket."""
        key = (drafted, bucket)
        if self._count.get(key, 0) < self.min_steps:
            return None
        secs, toks = self._avg[key]
        return secs / toks

    def refresh_gap(self, batch: int) -> int:
        """Drafting steps of this bucket between plain ones: ``refresh_every`` while drafting's
        measured lead (plain seconds per token over drafting's, minus 1) is at most
        ``refresh_lead`` or unknown, ``refresh_every * lead / refresh_lead`` beyond it, at most
        ``MAX_REFRESH_STRETCH * refresh_every``."""
        bucket = batch_bucket(batch)
        plain, drafting = self._per_token(False, bucket), self._per_token(True, bucket)
        if plain is None or drafting is None:
            return self.refresh_every
        lead = plain / drafting - 1.0 if drafting > 0.0 else math.inf
        stretch = min(float(MAX_REFRESH_STRETCH), max(1.0, lead / self.refresh_lead))
        return int(self.refresh_every * stretch)

    def wants_plain(self, batch: int) -> bool:
        """True while this bucket has had fewer than ``min_steps`` plain steps, or
        ``refresh_gap`` drafting steps since its last plain one."""
        bucket = batch_bucket(batch)
        return (self._count.get((False, bucket), 0) < self.min_steps
                or self._since_plain.get(bucket, 0) >= self.refresh_gap(batch))

    def allows_drafting(self, batch: int) -> bool:
        """False where both paths were measured and drafting did not emit tokens at least
        ``min_gain`` faster; once vetoed, until it emits them ``2 * min_gain`` faster."""
        plain, drafting = self.seconds_per_token(False, batch), self.seconds_per_token(True, batch)
        if plain is None or drafting is None:
            return True
        bucket = batch_bucket(batch)
        gain = 2.0 * self.min_gain if bucket in self._vetoed else self.min_gain
        allowed = drafting * (1.0 + gain) <= plain
        if allowed:
            self._vetoed.discard(bucket)
        else:
            self._vetoed.add(bucket)
        return allowed

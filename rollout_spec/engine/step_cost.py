"""What a step costs beyond the captured GPU forward, learned online from the engine's own clock.

The batch-aware budget compares ``T(B, k)``, the wall time of a step that drafts ``k`` nodes per
request. The measured GPU grid only covers the graphed forward. Everything else -- proposing,
building the tree inputs, the LM head and verification (device and host work), committing,
waiting for the drafter -- is the *residual*: the step's wall time minus the grid's prediction.
It differs between the plain path (no drafts) and the speculative path and grows with the batch
and the number of draft nodes, so each path gets its own small linear model,

    plain:        r0(B)    = a0 + b0 * B
    speculative:  r1(B, N) = a1 + b1 * B + c1 * N,

fitted by exponentially forgotten least squares (recent steps count most; the host's load and
the drafter's cost drift) with a weak ridge pull towards zero. Zero is an optimistic prior: a
path never measured looks cheap, so the budget tries it and learns its real cost.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from rollout_spec.config import check_float, check_int


@lru_cache(maxsize=None)
def batch_bucket(batch: int) -> int:
    """The half-octave of a batch size (B = 45..53 -> 11, 54..76 -> 12, ...): steps of one bucket
    cost about the same, so per-bucket models and decisions share their observations. Memoised:
    the budget and the guard ask several times per step, and batch sizes are few."""
    return int(round(2 * math.log2(check_int("batch", batch, 1, 1 << 20))))


class _ForgettingLeastSquares:
    """Weighted least squares whose old observations decay by ``1 - decay`` per update.

    The sums are Python floats, not numpy arrays: with one to three features an update through
    numpy cost ~15 us of allocations on the engine's thread (twice per step), in Python ~2 us.
    """

    def __init__(self, dims: int, decay: float, ridge: float) -> None:
        self.decay, self.ridge = decay, ridge
        self.xx = [[0.0] * dims for _ in range(dims)]
        self.xy = [0.0] * dims
        self.count = 0
        self._solved: np.ndarray | None = np.zeros(dims)

    def update(self, x: Sequence[float], y: float) -> None:
        """Add one observation ``y ~ x . theta`` (the solve waits until theta is read)."""
        keep = 1.0 - self.decay
        for i, xi in enumerate(x):
            row = self.xx[i]
            for j, xj in enumerate(x):
                row[j] = keep * row[j] + xi * xj
            self.xy[i] = keep * self.xy[i] + xi * y
        self.count += 1
        self._solved = None

    @property
    def theta(self) -> np.ndarray:
        """The fitted coefficients; solved once per batch of updates (plain steps update every
        step but the budget reads rarely)."""
        if self._solved is None:
            xx = np.asarray(self.xx) + self.ridge * np.eye(len(self.xy))
            self._solved = np.linalg.solve(xx, np.asarray(self.xy))
        return self._solved

    def predict(self, x: Sequence[float]) -> float:
        """``x . theta`` (0 before the first observation)."""
        return float(np.dot(x, self.theta))


class OnlineStepCost:
    """Residual step time (seconds) of the plain and the speculative path (see module docstring).

    Two levels: one global model per path over all batch sizes (features scaled by ``max_batch``
    and ``max_nodes``), and one small model per path and half-octave of B (the plain path a
    constant, the speculative path a + c * nodes-per-request). A bucket's own model predicts once
    it has ``min_local`` observations; before that the global one extrapolates. Draft nodes grow
    with B at a fixed size, so globally the per-request and per-node costs are hard to tell
    apart, and extrapolating them to a batch size never drafted at can be far off; the local
    models only interpolate. ``decay`` is the weight lost by old observations per update (0.05:
    about the last 20 steps count); ``ridge`` is the prior's weight in observations.
    """

    def __init__(self, max_batch: int, max_nodes: int, decay: float = 0.05, ridge: float = 0.5,
                 min_local: int = 3) -> None:
        self.max_batch = check_int("max_batch", max_batch, 1, 1 << 20)
        self.max_nodes = check_int("max_nodes", max_nodes, 1, 1 << 30)
        self.decay = check_float("decay", decay, 1e-6, 1.0)
        self.ridge = check_float("ridge", ridge, 1e-9, 1e6)
        self.min_local = check_int("min_local", min_local, 1, 1 << 20)
        self.plain = _ForgettingLeastSquares(2, decay, ridge)
        self.spec = _ForgettingLeastSquares(3, decay, ridge)
        self._local: dict[tuple[bool, int], _ForgettingLeastSquares] = {}

    def _features(self, drafted: bool, batch: int, nodes: float) -> tuple[float, ...]:
        b = batch / self.max_batch
        return (1.0, b, nodes / self.max_nodes) if drafted else (1.0, b)

    def _fill(self, batch: int, nodes: np.ndarray | float) -> np.ndarray | float:
        """Nodes per request as a fraction of the most a request may get."""
        return nodes * self.max_batch / (batch * self.max_nodes)

    def _local_model(self, drafted: bool, batch: int, create: bool = False) -> _ForgettingLeastSquares | None:
        key = (drafted, batch_bucket(batch))
        model = self._local.get(key)
        if model is None and create:
            model = self._local[key] = _ForgettingLeastSquares(2 if drafted else 1, self.decay, self.ridge)
        return model if model is not None and (create or model.count >= self.min_local) else None

    def observe(self, drafted: bool, batch: int, nodes: int, residual_seconds: float) -> None:
        """Record one step: which path, its batch size, draft nodes, and wall minus GPU grid time."""
        check_int("batch", batch, 1, 1 << 20)
        check_int("nodes", nodes, 0, 1 << 30)
        if not np.isfinite(residual_seconds):
            raise ValueError(f"residual_seconds must be finite, got {residual_seconds}")
        y = float(residual_seconds)
        (self.spec if drafted else self.plain).update(self._features(drafted, batch, nodes), y)
        local = self._local_model(drafted, batch, create=True)
        local.update((1.0, self._fill(batch, nodes)) if drafted else (1.0,), y)

    def residual(self, drafted: bool, batch: int, nodes: float) -> float:
        """Predicted seconds a step spends outside the graphed forward."""
        local = self._local_model(drafted, batch)
        if local is not None:
            return local.predict((1.0, self._fill(batch, nodes)) if drafted else (1.0,))
        return (self.spec if drafted else self.plain).predict(self._features(drafted, batch, nodes))

    def residuals(self, batch: int, nodes: np.ndarray) -> np.ndarray:
        """Vectorised ``residual``: the plain path where ``nodes == 0``, else the speculative one."""
        nodes = np.asarray(nodes, np.float64)
        local = self._local_model(True, batch)
        if local is not None:
            spec = local.theta @ np.stack([np.ones_like(nodes), self._fill(batch, nodes)])
        else:
            b = batch / self.max_batch
            spec = self.spec.theta @ np.stack([np.ones_like(nodes), np.full_like(nodes, b),
                                                nodes / self.max_nodes])
        return np.where(nodes > 0, spec, self.residual(False, batch, 0.0))

    def counts(self) -> tuple[int, int]:
        """Steps observed so far on the (plain, speculative) path."""
        return self.plain.count, self.spec.count

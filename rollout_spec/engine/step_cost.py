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

import numpy as np

from rollout_spec.config import check_float, check_int


class _ForgettingLeastSquares:
    """Weighted least squares whose old observations decay by ``1 - decay`` per update."""

    def __init__(self, dims: int, decay: float, ridge: float) -> None:
        self.decay, self.ridge = decay, ridge
        self.xx = np.zeros((dims, dims))
        self.xy = np.zeros(dims)
        self.count = 0
        self._theta = np.zeros(dims)

    def update(self, x: np.ndarray, y: float) -> None:
        """Add one observation ``y ~ x . theta``."""
        keep = 1.0 - self.decay
        self.xx = keep * self.xx + np.outer(x, x)
        self.xy = keep * self.xy + x * y
        self.count += 1
        self._theta = np.linalg.solve(self.xx + self.ridge * np.eye(len(x)), self.xy)

    def predict(self, x: np.ndarray) -> float:
        """``x . theta`` (0 before the first observation)."""
        return float(x @ self._theta)


class OnlineStepCost:
    """Residual step time (seconds) of the plain and the speculative path (see module docstring).

    Features are scaled by ``max_batch`` and ``max_nodes`` so one ridge strength suits both.
    ``decay`` is the weight lost by old observations per step of the same path (0.05: about the
    last 20 steps count); ``ridge`` is the prior's weight in observations.
    """

    def __init__(self, max_batch: int, max_nodes: int, decay: float = 0.05, ridge: float = 0.5) -> None:
        self.max_batch = check_int("max_batch", max_batch, 1, 1 << 20)
        self.max_nodes = check_int("max_nodes", max_nodes, 1, 1 << 30)
        check_float("decay", decay, 1e-6, 1.0)
        check_float("ridge", ridge, 1e-9, 1e6)
        self.plain = _ForgettingLeastSquares(2, decay, ridge)
        self.spec = _ForgettingLeastSquares(3, decay, ridge)

    def _features(self, drafted: bool, batch: int, nodes: float) -> np.ndarray:
        b = batch / self.max_batch
        return np.array([1.0, b, nodes / self.max_nodes]) if drafted else np.array([1.0, b])

    def observe(self, drafted: bool, batch: int, nodes: int, residual_seconds: float) -> None:
        """Record one step: which path, its batch size, draft nodes, and wall minus GPU grid time."""
        check_int("batch", batch, 1, 1 << 20)
        check_int("nodes", nodes, 0, 1 << 30)
        if not np.isfinite(residual_seconds):
            raise ValueError(f"residual_seconds must be finite, got {residual_seconds}")
        model = self.spec if drafted else self.plain
        model.update(self._features(drafted, batch, nodes), float(residual_seconds))

    def residual(self, drafted: bool, batch: int, nodes: float) -> float:
        """Predicted seconds a step spends outside the graphed forward."""
        model = self.spec if drafted else self.plain
        return model.predict(self._features(drafted, batch, nodes))

    def residuals(self, batch: int, nodes: np.ndarray) -> np.ndarray:
        """Vectorised ``residual``: the plain path where ``nodes == 0``, else the speculative one."""
        nodes = np.asarray(nodes, np.float64)
        b = batch / self.max_batch
        spec = self.spec._theta @ np.stack([np.ones_like(nodes), np.full_like(nodes, b), nodes / self.max_nodes])
        return np.where(nodes > 0, spec, self.plain._theta @ np.array([1.0, b]))

    def counts(self) -> tuple[int, int]:
        """Steps observed so far on the (plain, speculative) path."""
        return self.plain.count, self.spec.count

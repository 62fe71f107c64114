"""Pricing a drained call by its end: the slowest request's steps, not the batch's tokens.

While samples wait for a slot, every token a step emits brings the next admission closer, so
the budget maximises tokens per second (``budget.DraftBudget``). Once nothing waits, the call
lasts until its slowest request ends, and drafting that raises the batch's tokens per second
can still lose: the requests with the most tokens left are often those the drafter helps
least. On the shared T=1.0 traces 40% of the responses run to the length cap; a synchronous
batch of 128 shortens its longest wait by only 1.07-1.24x against a TPF of 1.50-1.56, and an
H200 ran such a batch 7% slower with drafting than without (docs/gpu.md, session 69).

``CallEnd`` keeps each request's acceptance relative to the batch's: decayed sums of the nodes
it kept on drafting steps and of what the batch's running mean expected at the size it was
offered. Their ratio ``rho``, pulled towards 1 by ``prior_steps`` pseudo-steps, scales the
batch's expected accepted nodes at size k for that request. With ``room[i]`` tokens left, the
call needs ``max_i room[i] / (1 + rho[i] * accepted(k))`` more steps at size k, so the gain the
budget weighs against the step's cost is ``max(room)`` over that: for equal rooms and rho = 1
it is the batch's own E(k), and the slowest request's acceptance decides.

Why the pull towards 1: a request's ratio rests on a few dozen noisy steps, and the maximum over
a batch of 128 picks out the unluckiest. ``bench/drained_call.py`` (calls of 16 prompts x 8 from
the shared traces, the engine's budget on a modelled H200 step) runs T=1.0 calls at 0.96-0.97x
plain decoding's speed under the throughput rule and 0.99x under this one (5 pseudo-steps,
decay 0.05), T=0.6 alike under both (1.67-1.78x); with 2 pseudo-steps T=0.6 lost up to 5%, with
10 T=1.0 kept 1-2% of its loss. On an H200 one batch of 128 at T=1.0 went from 0.87-0.88x to
0.97-0.98x (docs/gpu.md, session 70).
"""
from __future__ import annotations

import numpy as np

from rollout_spec.config import check_float


class CallEnd:
    """Per-request acceptance relative to the batch's, and the drained call's gain per draft size.

    ``decay`` is the weight a request's history loses per observation; ``prior_steps`` is how many
    observations of ratio 1 every request starts with. Histories are arrays sorted by request id,
    so a step's update is a few vectorised operations (a dict per request cost ~0.1 ms a step
    at B=256 on the 2-core VM).
    """

    def __init__(self, decay: float = 0.05, prior_steps: float = 5.0) -> None:
        self.decay = check_float("decay", decay, 1e-6, 1.0)
        self.prior_steps = check_float("prior_steps", prior_steps, 0.0, 1e6)
        self._ids = np.empty(0, np.int64)  # sorted request ids with a history
        self._kept = np.empty(0)  # decayed sum of the nodes each kept
        self._expected = np.empty(0)  # decayed sum of what the batch's mean expected of it

    def __len__(self) -> int:
        """Requests with a history."""
        return len(self._ids)

    def _find(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each id's row in the histories, and whether it has one."""
        rows = np.minimum(np.searchsorted(self._ids, ids), max(len(self._ids) - 1, 0))
        found = self._ids[rows] == ids if len(self._ids) else np.zeros(len(ids), bool)
        return rows, found

    def observe(self, req_ids: np.ndarray, accepted: np.ndarray, expected: np.ndarray) -> None:
        """One drafting step: request ``req_ids[r]`` kept ``accepted[r]`` nodes where the batch's
        running mean at the size it was offered expected ``expected[r]`` (requests offered none
        are left out by the caller; each id at most once)."""
        ids = np.asarray(req_ids, np.int64)
        got = np.asarray(accepted, np.float64)
        want = np.asarray(expected, np.float64)
        if not (ids.shape == got.shape == want.shape) or ids.ndim != 1:
            raise ValueError(f"req_ids, accepted and expected must be 1-D of one length, got shapes "
                             f"{ids.shape}, {got.shape}, {want.shape}")
        if not all(np.isfinite(a).all() and (a >= 0).all() for a in (got, want)):
            raise ValueError("accepted and expected must be finite and >= 0")
        ordered = np.sort(ids)
        if np.any(ordered[1:] == ordered[:-1]):
            raise ValueError("req_ids must not repeat within one step")
        rows, found = self._find(ids)
        if not found.all():  # first figures of some requests: give them rows, keep the order
            self._ids = np.concatenate([self._ids, ids[~found]])
            self._kept = np.concatenate([self._kept, np.zeros(int((~found).sum()))])
            self._expected = np.concatenate([self._expected, np.zeros(int((~found).sum()))])
            order = np.argsort(self._ids, kind="stable")
            self._ids, self._kept, self._expected = self._ids[order], self._kept[order], self._expected[order]
            rows, _ = self._find(ids)
        keep = 1.0 - self.decay
        self._kept[rows] = keep * self._kept[rows] + got
        self._expected[rows] = keep * self._expected[rows] + want

    def ratios(self, req_ids: np.ndarray, scale: float) -> np.ndarray:
        """Each request's acceptance over the batch's, with ``prior_steps`` pseudo-steps of ratio
        1 that each expected ``scale`` nodes (1 where nothing is known)."""
        ids = np.asarray(req_ids, np.int64)
        rows, found = self._find(ids)
        prior = self.prior_steps * max(scale, 0.0)
        kept = np.where(found, self._kept[rows] if len(self._ids) else 0.0, 0.0) + prior
        expected = np.where(found, self._expected[rows] if len(self._ids) else 0.0, 0.0) + prior
        return np.where(expected > 1e-12, kept / np.maximum(expected, 1e-12), 1.0)

    def gains(self, req_ids: np.ndarray, room: np.ndarray, mean_accepted: np.ndarray) -> np.ndarray:
        """The drained call's gain at each draft size: ``max(room)`` over the steps its slowest
        request needs when offered a size whose batch mean keeps ``mean_accepted[j]`` nodes
        (1.0 where that mean is 0: plain decoding's)."""
        room = np.asarray(room, np.float64)
        mean_accepted = np.asarray(mean_accepted, np.float64)
        if room.shape != (len(req_ids),) or len(room) == 0:
            raise ValueError(f"room must hold one entry per request, got shape {room.shape} "
                             f"for {len(req_ids)} requests")
        most = float(room.max())
        if most <= 0:
            return np.ones(len(mean_accepted))
        rho = self.ratios(req_ids, float(mean_accepted.max(initial=0.0)))
        steps = (room[:, None] / (1.0 + rho[:, None] * mean_accepted[None, :])).max(axis=0)
        return most / steps

    def retain(self, req_ids: np.ndarray) -> None:
        """Forget every request but these (the running ones): finished requests' history goes."""
        keep = np.isin(self._ids, np.asarray(req_ids, np.int64))
        self._ids, self._kept, self._expected = self._ids[keep], self._kept[keep], self._expected[keep]

"""Draft trees in CSR form (DESIGN.md's DraftBatch) and what one verify forward needs from them."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DraftBatch:
    """Draft trees of B requests in CSR form.

    Request b owns ``tokens[offsets[b]:offsets[b+1]]``; ``parents`` index within that slice, -1
    meaning the request's last committed token (the root). Nodes are topologically ordered and
    siblings best first; ``probs`` are drafter confidences, never used for acceptance.
    """

    offsets: np.ndarray  # int32[B+1], offsets[0] == 0, non-decreasing
    tokens: np.ndarray  # int32[N]
    parents: np.ndarray  # int32[N], -1 or an earlier index of the same slice
    probs: np.ndarray  # float32[N]

    @property
    def num_requests(self) -> int:
        """B, the number of requests (empty trees included)."""
        return len(self.offsets) - 1

    @property
    def num_nodes(self) -> int:
        """N, the total number of draft nodes."""
        return int(self.offsets[-1]) if len(self.offsets) else 0

    def sizes(self) -> np.ndarray:
        """Draft nodes per request, int64[B]."""
        return np.diff(self.offsets.astype(np.int64))

    @staticmethod
    def empty(num_requests: int) -> "DraftBatch":
        """A batch in which no request has a draft."""
        return DraftBatch(
            offsets=np.zeros(num_requests + 1, np.int32),
            tokens=np.zeros(0, np.int32),
            parents=np.zeros(0, np.int32),
            probs=np.zeros(0, np.float32),
        )

    @staticmethod
    def from_lists(
        trees: list[list[tuple[int, int]]], probs: list[list[float]] | None = None
    ) -> "DraftBatch":
        """Build a batch from per-request lists of ``(token, parent)`` pairs (tests, adapters)."""
        sizes = [len(t) for t in trees]
        offsets = np.zeros(len(trees) + 1, np.int32)
        offsets[1:] = np.cumsum(sizes)
        flat = [node for tree in trees for node in tree]
        flat_probs = [p for ps in probs for p in ps] if probs is not None else [1.0] * len(flat)
        batch = DraftBatch(
            offsets=offsets,
            tokens=np.array([t for t, _ in flat], np.int32).reshape(-1),
            parents=np.array([p for _, p in flat], np.int32).reshape(-1),
            probs=np.array(flat_probs, np.float32).reshape(-1),
        )
        batch.validate()
        return batch

    def validate(self) -> None:
        """Raise ValueError naming the field when the batch breaks the CSR tree contract."""
        for name, dtype in (("offsets", np.int32), ("tokens", np.int32), ("parents", np.int32)):
            arr = getattr(self, name)
            if not isinstance(arr, np.ndarray) or arr.dtype != dtype or arr.ndim != 1:
                raise ValueError(f"DraftBatch.{name} must be a 1-D int32 numpy array")
        if not isinstance(self.probs, np.ndarray) or self.probs.dtype != np.float32:
            raise ValueError("DraftBatch.probs must be a 1-D float32 numpy array")
        if len(self.offsets) < 1 or self.offsets[0] != 0:
            raise ValueError("DraftBatch.offsets must start with 0 and have B+1 entries")
        sizes = self.sizes()
        if (sizes < 0).any():
            raise ValueError("DraftBatch.offsets must be non-decreasing")
        n = self.num_nodes
        for name in ("tokens", "parents", "probs"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"DraftBatch.{name} has {len(getattr(self, name))} entries, offsets say {n}"
                )
        if (self.tokens < 0).any():
            raise ValueError("DraftBatch.tokens must be non-negative token ids")
        local = np.arange(n, dtype=np.int64) - np.repeat(self.offsets[:-1].astype(np.int64), sizes)
        if ((self.parents < -1) | (self.parents >= local)).any():
            raise ValueError(
                "DraftBatch.parents[i] must be -1 or in [0, i) within its request's slice "
                "(topological order)"
            )

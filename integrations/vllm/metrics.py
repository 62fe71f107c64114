"""Read acceptance from vLLM's own spec-decode metrics.

vLLM's scheduler counts, for every verify step of a request that carried a draft, the drafted
and the accepted tokens (``SpecDecodingStats``) and publishes them as Prometheus counters. Our
proposer's drafts go through the same scheduler and rejection sampler, so these counters are the
acceptance of rollout-spec's drafts. This file turns a metrics snapshot (``LLM.get_metrics()`` or
``vllm.v1.metrics.reader.get_metrics_snapshot()``) into our figures; it never imports vLLM.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

NUM_DRAFTS = "vllm:spec_decode_num_drafts"
NUM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
NUM_ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclass(frozen=True)
class SpecDecodeCounters:
    """Cumulative spec-decode counters of one or more vLLM engines (summed over engine labels)."""

    num_drafts: int = 0
    """Verify steps of a request that carried at least one draft token."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()
    """Accepted tokens at draft position i (0 = first draft token)."""

    @staticmethod
    def from_metrics(metrics: Iterable[Any]) -> "SpecDecodeCounters":
        """Sum the spec-decode entries of a vLLM metrics snapshot (objects with ``name`` and
        ``value``, or ``values`` for the per-position vector); other metrics are ignored."""
        totals = {NUM_DRAFTS: 0, NUM_DRAFT_TOKENS: 0, NUM_ACCEPTED_TOKENS: 0}
        per_pos: list[int] = []
        for metric in metrics:
            name = getattr(metric, "name", None)
            if name in totals:
                totals[name] += int(metric.value)
            elif name == ACCEPTED_PER_POS:
                values = [int(v) for v in metric.values]
                per_pos += [0] * (len(values) - len(per_pos))
                per_pos = [a + b for a, b in zip(per_pos, values + [0] * len(per_pos))]
        return SpecDecodeCounters(
            totals[NUM_DRAFTS], totals[NUM_DRAFT_TOKENS], totals[NUM_ACCEPTED_TOKENS], tuple(per_pos)
        )

    def __add__(self, other: "SpecDecodeCounters") -> "SpecDecodeCounters":
        """Counts of two engines (or two periods) together."""
        return self._combine(other, 1)

    def __sub__(self, other: "SpecDecodeCounters") -> "SpecDecodeCounters":
        """Counts accumulated since the ``other`` snapshot (e.g. during one RL step)."""
        return self._combine(other, -1)

    def _combine(self, other: "SpecDecodeCounters", sign: int) -> "SpecDecodeCounters":
        n = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        mine = list(self.accepted_per_pos) + [0] * (n - len(self.accepted_per_pos))
        theirs = list(other.accepted_per_pos) + [0] * (n - len(other.accepted_per_pos))
        return SpecDecodeCounters(
            self.num_drafts + sign * other.num_drafts,
            self.num_draft_tokens + sign * other.num_draft_tokens,
            self.num_accepted_tokens + sign * other.num_accepted_tokens,
            tuple(a + sign * b for a, b in zip(mine, theirs)),
        )

    @property
    def accept_rate(self) -> float:
        """Accepted draft tokens / drafted tokens (0 when nothing was drafted)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def accept_length(self) -> float:
        """Tokens emitted per verify step of a drafted request: 1 (the bonus token) + accepted
        per draft; this is DESIGN.md's TPF restricted to steps that carried a draft."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def as_log_dict(self, prefix: str = "rollout/") -> dict[str, float]:
        """Flat dict for a trainer's logger; OpenRLHF adds its own ``train/`` in front."""
        return {
            f"{prefix}spec_accept_rate": self.accept_rate,
            f"{prefix}spec_accept_length": self.accept_length,
            f"{prefix}spec_num_drafts": float(self.num_drafts),
            f"{prefix}spec_num_draft_tokens": float(self.num_draft_tokens),
            f"{prefix}spec_num_accepted_tokens": float(self.num_accepted_tokens),
        }

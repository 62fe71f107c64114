"""Host arrays of the running batch and the vectorised commit of a step's emitted tokens.

A decode step needs a few numbers per running sequence (slot, cached length, root token,
remaining room) and, after verification, must cut each request's emitted tokens at a stop token
or a length limit. Doing that per sequence in Python costs microseconds per request per step;
here it is one pass to gather the numbers and a few numpy operations for the cuts, so the only
per-sequence Python left is appending the kept tokens to each sequence's lists.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rollout_spec.engine.sequence import Sequence

REASON_NONE, REASON_STOP, REASON_LENGTH = 0, 1, 2
_REASONS = (None, "stop", "length")


@dataclass(frozen=True)
class RunningBatch:
    """int64 arrays over the running sequences, in their running order."""

    slot: np.ndarray
    prompt_len: np.ndarray
    out_len: np.ndarray
    root: np.ndarray  # last committed token: column 0 of the next tree
    req_id: np.ndarray
    max_new: np.ndarray

    @staticmethod
    def of(seqs: list[Sequence]) -> "RunningBatch":
        """Gather the arrays in one pass over the sequences."""
        rows = [(s.slot, len(s.prompt), len(s.output), s.output[-1], s.req_id, s.params.max_new_tokens)
                for s in seqs]
        a = np.array(rows, np.int64).reshape(len(seqs), 6).T
        return RunningBatch(*a)

    @property
    def ctx_len(self) -> np.ndarray:
        """Cached tokens per request (everything committed but the root)."""
        return self.prompt_len + self.out_len - 1

    def room(self, max_len: int) -> np.ndarray:
        """Tokens each request may still commit (max_new_tokens and the model length)."""
        return np.minimum(self.max_new - self.out_len, max_len - self.prompt_len - self.out_len)


def stop_mask(seqs: list[Sequence], req_of_token: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """bool per emitted token: it is one of its request's stop tokens."""
    first = seqs[0].stop_ids if seqs else frozenset()
    if all(s.stop_ids is first for s in seqs):  # one SamplingParams per call: the common case
        return np.isin(tokens, np.fromiter(first, np.int64, len(first)))
    stops = [seqs[r].stop_ids for r in req_of_token.tolist()]
    return np.fromiter((t in s for t, s in zip(tokens.tolist(), stops)), bool, len(tokens))


def plan_commit(offsets: np.ndarray, tokens: np.ndarray, is_stop: np.ndarray, out_len: np.ndarray,
                max_new: np.ndarray, left: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """How many of each request's emitted tokens to keep, and why the request ends (if it does).

    Args:
        offsets: int64[B+1] CSR offsets of the emitted tokens; tokens: their ids.
        is_stop: bool per emitted token.
        out_len, max_new: committed output length and max_new_tokens per request.
        left: model-length room per request (max_len - prompt - output), before this step.
    Returns:
        ``keep`` int64[B] and ``reason`` int8[B] (REASON_NONE / REASON_STOP / REASON_LENGTH),
        cut at the first stop token, at max_new_tokens or at the model length.
    """
    counts = np.diff(offsets)
    keep = np.minimum(counts, np.maximum(np.minimum(max_new - out_len, left), 0))
    req = np.repeat(np.arange(len(counts)), counts)
    index = np.arange(len(tokens)) - offsets[:-1][req]
    hits = np.flatnonzero(is_stop & (index < keep[req]))
    stopped = np.zeros(len(counts), bool)
    if len(hits):  # hits are in token order, so the first of each request comes first
        reqs, first = np.unique(req[hits], return_index=True)
        keep[reqs] = index[hits[first]] + 1
        stopped[reqs] = True
    ends = (out_len + keep >= max_new) | (keep >= left)
    reason = np.where(stopped, REASON_STOP, np.where(ends, REASON_LENGTH, REASON_NONE)).astype(np.int8)
    return keep, reason


def reason_name(code: int) -> str | None:
    """The finish reason string of a REASON_* code."""
    return _REASONS[code]

"""The target distribution that verification and plain sampling both draw from.

For a row of raw logits ``l`` and its request's SamplingParams, the distribution is
``softmax(mask(l / T))`` where ``mask`` keeps (1) tokens whose scaled logit is at least the k-th
largest (top-k; ties at the boundary are kept) and then (2) the shortest most-likely prefix of
that renormalised distribution whose mass reaches top_p (the token that crosses top_p is kept).
Greedy rows (T = 0) use T = 1 and no truncation, so their log-probabilities are the raw
log-softmax and their choice is the argmax. One function computes this for every row of a verify
step, so speculative and plain decoding report identical log-probabilities.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from rollout_spec.config import SamplingParams, check_int
from rollout_spec.noise import MAX_VERIFY_VOCAB


TOP_P_CANDIDATES = 1024
"""Largest logits ranked per row for a top-p cut without top-k (a full sort when too few)."""


@dataclass(frozen=True)
class SamplingTable:
    """Per-request sampling parameters of one batch as host arrays, plus flags that let the
    verifier skip work no request needs (sorting for top-k/top-p, the greedy or the sampling law).

    The arrays are read-only: tables of batches sharing one SamplingParams are cached and
    reused step after step, together with the facts derived from them. Build tables with
    ``from_params``, which checks its input (through SamplingParams) and freezes the arrays;
    the constructor takes its arrays as they are.
    """

    temperature: np.ndarray  # float32[B]; 0 means greedy
    top_k: np.ndarray  # int64[B]; -1 keeps all
    top_p: np.ndarray  # float32[B]; 1 keeps all
    uniform: bool  # every request has the same parameters (scalars suffice on the device)
    # Derived facts per vocabulary size (truncates, candidates): computed once per table.
    _memo: dict = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def from_params(
        sampling: SamplingParams | Sequence[SamplingParams], num_requests: int
    ) -> "SamplingTable":
        """Accept one SamplingParams for all requests or a sequence of B of them;
        ``num_requests`` (B) in [0, 2**31 - 1]."""
        num_requests = check_int("num_requests", num_requests, 0, 2**31 - 1)
        if isinstance(sampling, SamplingParams):
            return _uniform_table(sampling.temperature, sampling.top_k, sampling.top_p,
                                  num_requests)
        if isinstance(sampling, Sequence) and not isinstance(sampling, (str, bytes)):
            params = list(sampling)
            if len(params) != num_requests:
                raise ValueError(
                    f"sampling must be one SamplingParams or B={num_requests} of them, "
                    f"got {len(params)}"
                )
        else:
            raise TypeError(f"sampling must be SamplingParams or a sequence of them, "
                            f"got {type(sampling).__name__}")
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling[{i}] must be SamplingParams, got {type(p).__name__}")
        keys = {(p.temperature, p.top_k, p.top_p) for p in params}
        if len(keys) <= 1:
            return _uniform_table(*(keys.pop() if keys else (1.0, -1, 1.0)), num_requests)
        return _table(np.array([p.temperature for p in params], np.float32).reshape(-1),
                      np.array([p.top_k for p in params], np.int64).reshape(-1),
                      np.array([p.top_p for p in params], np.float32).reshape(-1), False)

    @cached_property
    def any_greedy(self) -> bool:
        """Some request decodes greedily."""
        return bool((self.temperature == 0).any())

    @cached_property
    def any_sampling(self) -> bool:
        """Some request samples (temperature > 0)."""
        return bool((self.temperature > 0).any())

    def truncates(self, vocab_size: int) -> bool:
        """Some sampling request keeps fewer than all tokens (needs the per-row sort);
        ``vocab_size`` in [1, MAX_VERIFY_VOCAB]."""
        vocab_size = check_int("vocab_size", vocab_size, 1, MAX_VERIFY_VOCAB)
        key = ("truncates", vocab_size)
        if key not in self._memo:
            sampling = self.temperature > 0
            k_cuts = (self.top_k > 0) & (self.top_k < vocab_size)
            self._memo[key] = bool((sampling & (k_cuts | (self.top_p < 1))).any())
        return self._memo[key]

    def cut_candidates(self, vocab_size: int) -> int:
        """How many of each row's largest logits decide every truncation cut: one more than the
        largest top-k (a tie of the k-th value continuing past the list then shows), at least
        TOP_P_CANDIDATES when some request has top-p without top-k; at most V (``vocab_size``,
        in [1, MAX_VERIFY_VOCAB])."""
        vocab_size = check_int("vocab_size", vocab_size, 1, MAX_VERIFY_VOCAB)
        key = ("cut_candidates", vocab_size)
        if key not in self._memo:
            sampling = self.temperature > 0
            top_k = np.where(sampling & (self.top_k > 0), np.minimum(self.top_k, vocab_size),
                             vocab_size)
            k_cut = top_k < vocab_size
            need_p = bool((~k_cut & sampling & (self.top_p < 1)).any())
            self._memo[key] = min(vocab_size, max(int(top_k[k_cut].max(initial=0)) + 1,
                                                  TOP_P_CANDIDATES * need_p))
        return self._memo[key]


def _table(temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
           uniform: bool) -> SamplingTable:
    """A SamplingTable over read-only copies of the arrays."""
    for a in (temperature, top_k, top_p):
        a.flags.writeable = False
    return SamplingTable(temperature=temperature, top_k=top_k, top_p=top_p, uniform=uniform)


@functools.lru_cache(maxsize=256)
def _uniform_table(temperature: float, top_k: int, top_p: float,
                   num_requests: int) -> SamplingTable:
    """The (cached) table of B requests sharing one set of parameters."""
    return _table(np.full(num_requests, temperature, np.float32),
                  np.full(num_requests, top_k, np.int64),
                  np.full(num_requests, top_p, np.float32), True)


@dataclass(frozen=True)
class RowStats:
    """Per-row facts of the target distributions of one verify step, on the logits' device."""

    temp: float | torch.Tensor  # effective temperature (1 for greedy): a float, or float32[R, 1]
    lse: torch.Tensor  # float32[R]: log-normaliser of the masked scaled logits
    thr: torch.Tensor | None  # float32[R]: smallest kept scaled logit; None when nothing is cut


def row_stats(
    logits: torch.Tensor, table: SamplingTable, rows_per_request: np.ndarray,
    temp_rows: torch.Tensor | None = None,
) -> RowStats:
    """Normalisers (and truncation thresholds) of every row's target distribution.

    Row r belongs to the request that ``rows_per_request`` (int64[B], summing to R) assigns it.
    ``temp_rows`` is float32[R] of effective temperatures on the device when the table is not
    uniform (the caller uploads it with its other per-step arrays). This is the torch reference
    of verify.py (verify_triton.py computes the same inside its kernel). Never modifies
    ``logits``. ``logits`` that are not a 2-D tensor, a ``rows_per_request`` of another length
    or sum, or a ``temp_rows`` that is not float32[R] on the logits' device raise.
    """
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a 2-D [R, V] tensor, got {type(logits).__name__}")
    if logits.ndim != 2:
        raise ValueError(f"logits must be a 2-D [R, V] tensor, got shape {list(logits.shape)}")
    vocab = logits.shape[1]
    _check_rows_per_request(rows_per_request, len(table.temperature), logits.shape[0])
    if table.uniform:
        temps = effective_temperature(table)
        temp: float | torch.Tensor = float(temps[0]) if len(temps) else 1.0
    else:
        _check_temp_rows(temp_rows, logits)
        temp = temp_rows[:, None]
    scores = scale(logits, temp)
    thr = None
    if table.truncates(vocab):
        sampling = table.temperature > 0
        top_k = np.where(sampling & (table.top_k > 0), np.minimum(table.top_k, vocab), vocab)
        top_p = np.where(sampling, table.top_p, np.float32(1.0))
        per_row = [np.repeat(a, rows_per_request) for a in (top_k, top_p)]
        k_rows, p_rows = (torch.from_numpy(a).to(logits.device) for a in per_row)
        # Rank only as many candidates as a cut can need: the largest top-k, or a prefix that
        # usually holds the top-p mass (checked; the whole row is sorted when it does not).
        k_cut = top_k < vocab
        need_p = (~k_cut & (top_p < 1)).any()
        cands = max(int(top_k[k_cut].max(initial=0)), TOP_P_CANDIDATES if need_p else 0)
        thr = _truncation_threshold(scores, k_rows, p_rows, min(cands, vocab))
        # Out of place: with float32 logits and T = 1, scores still aliases the caller's logits.
        scores = scores.masked_fill(scores < thr[:, None], float("-inf"))
    return RowStats(temp=temp, lse=row_logsumexp(scores), thr=thr)


def row_logsumexp(scores: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    """Log-sum-exp over the last dim of a [R, V] tensor, the same for a row whatever the other
    rows are.

    On the CPU torch reduces a lone row split over its threads (the one-output path) and two or
    more rows row by row, which rounds differently: a row's normaliser (so its logprobs and its
    top-p cut) changed with whatever else was in the call. A lone row is therefore reduced as
    the first of two copies (tests/test_verify.py). Summing in float64 instead cost 3x on the
    CPU and has no MPS kernel.
    """
    if scores.shape[0] == 1:
        return torch.logsumexp(scores.repeat(2, 1), dim=-1, keepdim=keepdim)[:1]
    return torch.logsumexp(scores, dim=-1, keepdim=keepdim)


def _check_rows_per_request(counts: np.ndarray, num_requests: int, num_rows: int) -> None:
    """ValueError unless ``counts`` is int[num_requests] of counts >= 1 summing to ``num_rows``."""
    counts = np.asarray(counts)
    if counts.shape != (num_requests,) or counts.dtype.kind not in "iu":
        raise ValueError(f"rows_per_request must be int64[B={num_requests}], "
                         f"got {counts.dtype}{list(counts.shape)}")
    if counts.sum() != num_rows or (num_requests and counts.min() < 1):
        raise ValueError(f"rows_per_request must hold counts >= 1 summing to the logits' "
                         f"{num_rows} rows, got min {counts.min(initial=1)}, sum {counts.sum()}")


def _check_temp_rows(temp_rows: torch.Tensor | None, logits: torch.Tensor) -> None:
    """Raise unless ``temp_rows`` is float32[R] on the logits' device (TypeError for a
    non-tensor, else ValueError): a shorter one would broadcast one request's temperature over
    every row."""
    want = f"float32[{logits.shape[0]}] on {logits.device}"
    if temp_rows is None:
        raise ValueError(f"temp_rows ({want}) is required when requests differ")
    if not isinstance(temp_rows, torch.Tensor):
        raise TypeError(f"temp_rows must be {want}, got {type(temp_rows).__name__}")
    if (temp_rows.dtype, tuple(temp_rows.shape), temp_rows.device) != (
            torch.float32, (logits.shape[0],), logits.device):
        raise ValueError(f"temp_rows must be {want}, got {temp_rows.dtype}"
                         f"{list(temp_rows.shape)} on {temp_rows.device}")


def effective_temperature(table: SamplingTable) -> np.ndarray:
    """float32[B]: the temperature that divides the logits (1 for greedy requests)."""
    return np.where(table.temperature > 0, table.temperature, np.float32(1.0)).astype(np.float32)


def scale(logits: torch.Tensor, temp: float | torch.Tensor) -> torch.Tensor:
    """``logits / temp`` in float32, the IEEE quotient on every device (no copy at T = 1).

    torch divides a CUDA tensor by a Python number as a multiplication by its reciprocal, which
    can differ in the last bit; thresholds, node logprobs (divided on the host) and the Triton
    kernel (``div_rn``) must all see the same scaled logit, so the divisor is a device tensor.
    """
    scores = logits.float()
    if isinstance(temp, float):
        if temp == 1.0:
            return scores
        temp = torch.full((), temp, dtype=torch.float32, device=scores.device)
    return scores / temp


def target_scores_of_rows(
    logits: torch.Tensor, stats: RowStats, rows: torch.Tensor, temp: float | torch.Tensor
) -> torch.Tensor:
    """float32[len(rows), V]: masked scaled logits of the selected rows (-inf outside the kept
    set); ``temp`` is the rows' effective temperature (a float or float32[len(rows), 1])."""
    scores = scale(logits[rows], temp)
    if stats.thr is not None:
        scores = scores.masked_fill(scores < stats.thr[rows][:, None], float("-inf"))
    return scores


def _truncation_threshold(
    scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, candidates: int
) -> torch.Tensor:
    """Per-row smallest scaled logit that top-k then top-p keep (float32[R]).

    ``top_k`` int64[R] in [1, V] (V keeps all), ``top_p`` float32[R] in (0, 1] (1 keeps all).
    Only the ``candidates`` largest logits of each row are ranked (topk, not a full sort); the
    result equals a full sort's whenever every row's cut falls among them, which is checked
    (one synchronisation) before the whole rows are sorted instead.
    """
    vocab = scores.shape[1]
    if candidates >= vocab:
        ordered = scores.sort(dim=-1, descending=True).values
    else:
        ordered = scores.topk(candidates, dim=-1).values  # largest first
    n = ordered.shape[1]
    thr_k = ordered.gather(1, (top_k.clamp(max=n) - 1)[:, None])
    thr_k = thr_k.masked_fill((top_k >= vocab)[:, None], float("-inf"))
    # The normaliser covers every kept token, ties beyond the candidates included.
    lse_k = row_logsumexp(scores.masked_fill(scores < thr_k, float("-inf")), keepdim=True)
    probs = (ordered - lse_k).exp().masked_fill(ordered < thr_k, 0.0)
    mass = probs.cumsum(dim=-1)
    if n < vocab:
        covered = (top_k <= n) | (mass[:, -1] >= top_p) | (top_p >= 1)
        if not bool(covered.all()):
            return _truncation_threshold(scores, top_k, top_p, vocab)
    keep_n = ((mass - probs) < top_p[:, None]).sum(dim=-1).clamp(min=1)
    thr_p = ordered.gather(1, (keep_n - 1)[:, None])
    # Rounding can make the cumulative mass reach 1 before the tail: top_p = 1 must keep all.
    thr_p = thr_p.masked_fill((top_p >= 1)[:, None], float("-inf"))
    return torch.maximum(thr_k, thr_p).squeeze(1)

"""Lossless verification of draft trees against the target's logits (DESIGN.md, "Verification").

Law. At a node with target distribution p (sampling.py: temperature, then top-k, then top-p,
renormalised) the row's token x is drawn from p, and the first child carrying x is accepted; when
no child carries it, x is the bonus token. This is DESIGN's multi-branch rejection sampling with
point-mass drafts, the same law decided in one draw: child c (its earlier siblings rejected) is
accepted with probability p(c) / (mass not yet rejected), and a bonus drawn when every child was
rejected follows p with the children removed, renormalised. Greedy requests take the argmax. A
sibling repeating an earlier sibling's token is never accepted. The emitted tokens have exactly
the law of plain sampling from the target, one token at a time.

Coupled noise. x is drawn by a Gumbel race, argmax of ``log p(v) + G_v`` with ``G_v = -log(-log1p(
-U_v))``, whose uniforms are keyed by (request seed, row position, token) (noise.py), not drawn
from a stream. A request at a given position races the same noise on every step, so from the
same logits a speculative step emits exactly the tokens that plain decoding would, and an
empty DraftBatch is plain sampling. U in (0, 1) makes every G finite, so every kept token
enters the race and no draw lands outside p's support.

Where the work runs. Two implementations. On CUDA (``backend="auto"``) the whole walk runs in one
Triton kernel, one program per request reading only the rows on its accepted path
(verify_fused.py, verify_triton.py): one launch, one small device-to-host copy. The torch path
below is the reference (and the CPU path): row statistics for every row, then the trees are
walked level by level, racing the rows the walk has reached (one device round trip per level).

Log-probabilities. Every emitted token (accepted or bonus) reports ``log p(token)`` under the
distribution it was drawn from at its parent: temperature-scaled, top-k/top-p truncated and
renormalised (for greedy, the log-softmax of the raw logits).
"""
from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from rollout_spec.config import SamplingParams
from rollout_spec.noise import NoiseKeys, race_uniforms
from rollout_spec.sampling import (
    RowStats,
    SamplingTable,
    effective_temperature,
    row_stats,
    target_scores_of_rows,
)
from rollout_spec.tree import DraftBatch, TreeInputs, to_device

_FIELDS = ("accepted_offsets", "accepted_nodes", "bonus", "emitted_offsets", "emitted_tokens",
           "emitted_logprobs", "num_accepted")


@dataclass(frozen=True)
class HostVerifyResult:
    """VerifyResult's arrays on the host (numpy), as verification computed them."""

    accepted_offsets: np.ndarray  # int64[B+1]
    accepted_nodes: np.ndarray  # int64[sum]; node indices within the slice, root to leaf
    bonus: np.ndarray  # int64[B]; the token drawn after the accepted path
    emitted_offsets: np.ndarray  # int64[B+1]
    emitted_tokens: np.ndarray  # int64[sum]; accepted tokens then the bonus
    emitted_logprobs: np.ndarray  # float32[sum]; log p(token) under its sampling distribution
    num_accepted: np.ndarray  # int64[B]; length of the accepted path


class VerifyResult:
    """Per-request outcome of one verify step, as CSR tensors on the logits' device.

    ``host`` holds the same data as numpy arrays (free); the tensor attributes are uploaded in
    one copy on first access, so a caller that needs the results on the host should read
    ``host`` rather than copy the tensors back. ``walk`` is the fused kernel's own result rows
    on the device (int32 ``[B, 1 + 3W]``: accepted count, accepted tree columns, emitted tokens,
    logprob bits), None on the torch path; device-side consumers read it without a copy.
    """

    accepted_offsets: torch.Tensor
    accepted_nodes: torch.Tensor
    bonus: torch.Tensor
    emitted_offsets: torch.Tensor
    emitted_tokens: torch.Tensor
    emitted_logprobs: torch.Tensor
    num_accepted: torch.Tensor

    def __init__(self, host: HostVerifyResult, walk: torch.Tensor | None = None, *,
                 device: torch.device) -> None:
        self.host, self.walk, self.device = host, walk, device

    @cached_property
    def _tensors(self) -> dict[str, torch.Tensor]:
        arrays = [getattr(self.host, name) for name in _FIELDS]
        return dict(zip(_FIELDS, to_device(arrays, self.device)))

    def __getattr__(self, name: str) -> torch.Tensor:
        if name in _FIELDS:
            return self._tensors[name]
        raise AttributeError(f"VerifyResult has no attribute {name!r}")

    def __repr__(self) -> str:
        return f"VerifyResult({self.host}, device={self.device})"


@dataclass(frozen=True)
class _Nodes:
    """Host index arrays of a batch's nodes, flat in slice order."""

    req: np.ndarray  # int64[N]: request of the node
    local: np.ndarray  # int64[N]: index within the request's slice
    tok: np.ndarray  # int64[N]: draft token
    parent_row: np.ndarray  # int64[N]: verify row of the parent (the root row under the root)
    node_row: np.ndarray  # int64[N]: verify row of the node itself
    root_row: np.ndarray  # int64[B]: verify row of each request's root

    @staticmethod
    def of(batch: DraftBatch) -> "_Nodes":
        """Index arrays of a validated batch."""
        num_req, sizes = batch.num_requests, batch.sizes()
        starts = batch.offsets[:-1].astype(np.int64)
        req = np.repeat(np.arange(num_req, dtype=np.int64), sizes)
        local = np.arange(batch.num_nodes, dtype=np.int64) - starts[req]
        root_row = starts + np.arange(num_req, dtype=np.int64)
        par = batch.parents.astype(np.int64)
        return _Nodes(req=req, local=local, tok=batch.tokens.astype(np.int64),
                      parent_row=root_row[req] + 1 + par, node_row=root_row[req] + 1 + local,
                      root_row=root_row)


def verify(
    logits: torch.Tensor,
    batch: DraftBatch,
    sampling: SamplingParams | Sequence[SamplingParams],
    generator: torch.Generator | None = None,
    *,
    keys: NoiseKeys | None = None,
    tree: TreeInputs | None = None,
    backend: str = "auto",
    on_walk: Callable[[torch.Tensor], None] | None = None,
) -> VerifyResult:
    """Accept a path of every request's draft tree and draw one bonus token after it.

    Args:
        logits: [B + N, V] target logits, one row per root and node, request b's root at row
            ``offsets[b] + b`` followed by its nodes in slice order.
        batch: the draft trees the logits were computed for.
        sampling: one SamplingParams for all requests, or B of them.
        generator: draws the requests' noise keys when ``keys`` is None (seeded runs
            reproduce); unused otherwise.
        keys: each request's noise key (seed, root position) on the logits' device; the engine
            passes its requests' own, so their draws do not depend on the step or the batch.
        tree: the TreeInputs of this forward; optional, only checked against the batch (the
            walk needs nothing that the batch does not already hold on the host).
        backend: "triton" (the whole walk in one kernel, verify_triton.py), "torch" (the
            reference: torch row statistics, numpy walk) or "auto" (triton on CUDA when it is
            installed). Same law, noise and logprobs.
        on_walk: triton backend only: called once with ``VerifyResult.walk`` (the walk's
            device rows) when its final values are queued, before the host waits for them --
            the engine queues its KV compaction there, so the GPU runs it without a host gap.
    Returns:
        VerifyResult (numpy arrays in ``.host``, device tensors on access).
    Raises:
        ValueError/TypeError naming the offending argument or field; NonFiniteLogits (a
        ValueError) naming the request whose logits are not finite (checked on the emitted
        logprobs, after the walk).
    """
    _check_optional_types(generator=(generator, torch.Generator), keys=(keys, NoiseKeys),
                          tree=(tree, TreeInputs))
    table = _check_inputs(logits, batch, sampling, tree)
    if keys is None:
        keys = NoiseKeys.fresh(generator, batch.num_requests, logits.device)
    else:
        keys.check(batch.num_requests, logits.device)
    logits = logits.detach()  # sampling is not differentiable; logits of a graph are read as values
    if batch.num_requests and use_triton(backend, logits.device):  # no request: nothing to launch
        from rollout_spec.verify_fused import verify_fused

        result = VerifyResult(*verify_fused(logits, batch, table, keys, tree, on_walk=on_walk),
                              device=logits.device)
    else:
        with np.errstate(invalid="ignore"):  # inf - inf of non-finite logits: refused just below
            result = VerifyResult(verify_torch(logits, batch, table, keys), device=logits.device)
    _check_finite(result.host)
    return result


class NonFiniteLogits(ValueError):
    """A request's logits held a NaN or +inf (or a finite logit that overflows float32 once divided
    by the temperature), or nothing but -inf: its tokens would not be a sample of anything.
    ``request`` is its place in the batch (callers name it their way)."""

    def __init__(self, request: int, logprob: float):
        super().__init__(f"logits of request {request} (its place in the batch) are not finite (a "
                         f"NaN or +inf logit, a finite one that overflows once divided by the temperature, "
                         f"or every logit -inf): its emitted logprob is {logprob}, "
                         f"not a log-probability")
        self.request = request


def _check_finite(host: HostVerifyResult) -> None:
    """NonFiniteLogits for the first request whose emitted logprobs are not finite."""
    bad = ~np.isfinite(host.emitted_logprobs)
    if bad.any():
        req = int(np.searchsorted(host.emitted_offsets, np.flatnonzero(bad)[0], side="right")) - 1
        raise NonFiniteLogits(req, float(host.emitted_logprobs[bad][0]))


def verify_torch(logits: torch.Tensor, batch: DraftBatch, table: SamplingTable, keys: NoiseKeys,
                 noise: torch.Tensor | None = None) -> HostVerifyResult:
    """The reference path for validated inputs: row statistics with torch, then a walk of all
    trees at once, level by level, racing the rows reached.

    ``noise`` (tests only) replaces the keyed uniforms: float32[R, V], row r's race uses row r.
    """
    dev, nodes = logits.device, _Nodes.of(batch)
    temps = effective_temperature(table)
    rows_per_req = batch.sizes() + 1
    temp_rows = None if table.uniform else np.repeat(temps, rows_per_req)
    uploads = [nodes.parent_row, nodes.tok, temps, table.temperature == 0] + (
        [temp_rows] if temp_rows is not None else [])
    dev_arrays = to_device(uploads, dev)
    stats = row_stats(logits, table, rows_per_req, dev_arrays[4] if temp_rows is not None else None)
    child_logit = logits[dev_arrays[0], dev_arrays[1]].float()
    child_logit, lse, thr = _fetch([child_logit, stats.lse, stats.thr])
    logp = _node_logprobs(nodes, temps, child_logit, lse, thr)
    num_req = batch.num_requests
    row, depth = nodes.root_row.copy(), np.zeros(num_req, np.int64)
    bonus, bonus_logp = np.zeros(num_req, np.int64), np.zeros(num_req, np.float32)
    active, accepted = np.ones(num_req, bool), []
    while active.any():
        reqs = np.flatnonzero(active)
        win_at = np.zeros(num_req, np.int64)
        win_at[reqs], score = _race(logits, stats, table, dev_arrays[2:4], keys, reqs, row[reqs],
                                    depth[reqs], noise)
        # The first child (slice order) of each active request's current row carrying its winner.
        carries = active[nodes.req] & (nodes.parent_row == row[nodes.req]) & (nodes.tok == win_at[nodes.req])
        hits = np.flatnonzero(carries)
        moved, first = np.unique(nodes.req[hits], return_index=True)
        chosen = hits[first]
        accepted.append(chosen)
        row[moved], depth[moved] = nodes.node_row[chosen], depth[moved] + 1
        ended = np.ones(len(reqs), bool)
        ended[np.searchsorted(reqs, moved)] = False
        done = reqs[ended]
        bonus[done] = win_at[done]
        bonus_logp[done] = score[ended] - lse[row[done]]
        active[done] = False
    acc_idx = np.sort(np.concatenate(accepted)) if accepted else np.zeros(0, np.int64)
    return _assemble(nodes, acc_idx, logp, bonus, bonus_logp, num_req)


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _is_cuda(device: torch.device) -> bool:
    """``device.type == "cuda"``, cached: reading ``type`` builds a str (~0.2 us a verify step)."""
    return device.type == "cuda"


def triton_runs_on(device: torch.device) -> bool:
    """Whether the Triton kernels can run for ``device``: compiled on CUDA, or anywhere through
    triton's interpreter (TRITON_INTERPRET=1, read by verify_triton when it is imported)."""
    return _is_cuda(device) or os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(backend: str, device: torch.device) -> bool:
    """Resolve ``backend``: "triton" (the fused kernel; an error without triton, or off CUDA
    without triton's interpreter), "torch" (the reference) or "auto" (triton on CUDA when it is
    installed).

    Raises:
        ValueError: an unknown ``backend``, or "triton" for a device other than CUDA while
            TRITON_INTERPRET=1 is not set (compiled kernels need a GPU).
        ImportError: "triton" without the triton package.
    """
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    if backend == "torch" or (backend == "auto" and not _is_cuda(device)):
        return False
    if not _triton_installed():
        if backend == "triton":
            raise ImportError("backend='triton' needs the triton package (pip install triton)")
        return False
    if backend == "triton" and not triton_runs_on(device):  # "auto" reaches here on CUDA only
        raise ValueError(f"backend='triton' needs a CUDA device or TRITON_INTERPRET=1 (triton's CPU "
                         f"interpreter, set before triton is imported), got device {device}")
    return True


def _check_optional_types(**args: tuple[object, type]) -> None:
    """TypeError naming the first argument (name -> (value, expected type)) that is neither None
    nor of its type: otherwise an attribute lookup deep in the call would fail without naming it."""
    for name, (value, expected) in args.items():
        if value is not None and not isinstance(value, expected):
            raise TypeError(f"{name} must be None or a {expected.__name__}, got {type(value).__name__}")


def _check_inputs(
    logits: torch.Tensor,
    batch: DraftBatch,
    sampling: SamplingParams | Sequence[SamplingParams],
    tree: TreeInputs | None,
) -> SamplingTable:
    """Validate every argument before any device work; return the sampling table."""
    if not isinstance(batch, DraftBatch):
        raise TypeError(f"batch must be a DraftBatch, got {type(batch).__name__}")
    batch.validate()
    rows = batch.num_requests + batch.num_nodes
    if not isinstance(logits, torch.Tensor) or logits.ndim != 2 or logits.shape[0] != rows:
        got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"logits must have shape [B + N, V] = [{rows}, V], got {got}")
    if not logits.is_floating_point() or not 1 <= logits.shape[1] < 2**24:
        raise ValueError(f"logits must be floating point with 1 <= V < 2**24, got "
                         f"{logits.dtype} with V={logits.shape[1]}")
    if batch.num_nodes and int(batch.tokens.max()) >= logits.shape[1]:
        raise ValueError(
            f"DraftBatch.tokens must be < V={logits.shape[1]}, got {int(batch.tokens.max())}"
        )
    if tree is not None and tree.source is not batch:  # built from this batch: fits it
        need = 1 + int(batch.sizes().max(initial=0))
        if tree.input_ids.shape[0] != batch.num_requests or tree.width < need:
            raise ValueError(
                f"tree must be built from this batch: [B, W>={need}] = "
                f"[{batch.num_requests}, >={need}], got {tuple(tree.input_ids.shape)}"
            )
    return SamplingTable.from_params(sampling, batch.num_requests)


def _fetch(tensors: list[torch.Tensor | None]) -> list[np.ndarray | None]:
    """Copy float32-representable tensors to the host in one transfer (None stays None).

    Integer tensors (argmax) are exact in float32 because V < 2**24 is checked up front.
    """
    present = [t for t in tensors if t is not None]
    flat = torch.cat([t.reshape(-1).float() for t in present]).cpu().numpy()
    out, pos = [], 0
    for t in tensors:
        if t is None:
            out.append(None)
            continue
        part = flat[pos : pos + t.numel()]
        out.append(part.astype(np.int64) if not t.is_floating_point() else part)
        pos += t.numel()
    return out


def _node_logprobs(nodes: _Nodes, temps: np.ndarray, child_logit: np.ndarray, lse: np.ndarray,
                   thr: np.ndarray | None) -> np.ndarray:
    """float32[N]: log p_parent(node token) under the parent's sampling distribution."""
    scaled = child_logit / temps[nodes.req]  # the same float32 division the device did
    logp = scaled - lse[nodes.parent_row]
    if thr is not None:
        logp = np.where(scaled >= thr[nodes.parent_row], logp, np.float32(-np.inf))
    return logp.astype(np.float32)


def _race(logits: torch.Tensor, stats: RowStats, table: SamplingTable,
          per_request: list[torch.Tensor], keys: NoiseKeys, reqs: np.ndarray, rows: np.ndarray,
          depth: np.ndarray, noise: torch.Tensor | None) -> tuple[np.ndarray, np.ndarray]:
    """Each row's sampled token (int64[A]: the Gumbel race of request reqs[a]'s noise at its
    root position + depth[a]; greedy requests: the argmax) and its masked scaled logit
    (float32[A]), for verify rows ``rows``. ``per_request`` holds the requests' effective
    temperatures and greedy flags on the device."""
    temps, greedy = per_request
    reqs_t, rows_t, depth_t = to_device([reqs, rows, depth], logits.device)
    temp = stats.temp if table.uniform else temps[reqs_t][:, None]
    scores = target_scores_of_rows(logits, stats, rows_t, temp)
    win = scores.argmax(dim=-1)
    if table.any_sampling:
        if noise is not None:
            u = noise[rows_t]
        else:
            u = race_uniforms(keys.seeds[reqs_t], keys.positions[reqs_t] + depth_t, logits.shape[1])
        # Exponential variates -log1p(-u), exact near 0 where u is fine (noise.py): the small
        # ones are what let a token far below the best win, at its probability.
        raced = (scores - (-torch.log1p(-u)).log()).argmax(dim=-1)
        win = torch.where(greedy[reqs_t], win, raced) if table.any_greedy else raced
    score = scores.gather(1, win[:, None]).squeeze(1)
    win_h, score_h = _fetch([win, score])
    return win_h, score_h


def _assemble(nodes: _Nodes, acc_idx: np.ndarray, logp: np.ndarray, bonus: np.ndarray,
              bonus_logp: np.ndarray, num_req: int) -> HostVerifyResult:
    """CSR of accepted nodes and emitted tokens (accepted then bonus) per request."""
    num_acc = np.bincount(nodes.req[acc_idx], minlength=num_req).astype(np.int64)
    acc_off = np.zeros(num_req + 1, np.int64)
    np.cumsum(num_acc, out=acc_off[1:])
    em_off = acc_off + np.arange(num_req + 1, dtype=np.int64)
    total = int(em_off[-1])
    # Accepted entry t of request b is emitted entry t + b; the bonus closes each request.
    slot = np.arange(len(acc_idx), dtype=np.int64) + nodes.req[acc_idx]
    tokens = np.empty(total, np.int64)
    logprobs = np.empty(total, np.float32)
    tokens[slot], logprobs[slot] = nodes.tok[acc_idx], logp[acc_idx]
    tokens[em_off[1:] - 1], logprobs[em_off[1:] - 1] = bonus, bonus_logp
    return HostVerifyResult(accepted_offsets=acc_off, accepted_nodes=nodes.local[acc_idx],
                            bonus=bonus, emitted_offsets=em_off, emitted_tokens=tokens,
                            emitted_logprobs=logprobs, num_accepted=num_acc)

"""Lossless verification of draft trees against the target's logits (DESIGN.md, "Verification").

Law. At a node with target distribution p (sampling.py: temperature, then top-k, then top-p,
renormalised), the children are tried in slice order: child c is accepted with probability
p(c) / (mass not yet rejected); a rejected child's mass is removed. If no child is accepted, the
bonus token is drawn from p with every child removed, renormalised. Greedy requests accept the
child equal to the argmax and emit the argmax as bonus. A sibling repeating an earlier sibling's
token has no mass left and is never accepted. The emitted tokens then have exactly the law of
plain sampling from the target, one token at a time.

Vectorisation. A child's acceptance, given that its parent was reached and its earlier siblings
were rejected, uses its own uniform draw, so every node's decision is computed at once; a node is
on the accepted path iff it and all its ancestors were their parent's first accepted child
(pointer jumping: a loop of log2(depth) numpy steps). No loop runs over requests or nodes.

Where the work runs. Two implementations of this law. On CUDA (``backend="auto"``) the whole
walk runs in one Triton kernel, one program per request reading only the rows on its accepted
path (verify_fused.py, verify_triton.py): one launch, one small device-to-host copy. The torch
path below is the reference (and the CPU path): everything of size [rows, V] runs on the logits'
device, the O(N) integer walk in numpy, with two device-to-host copies (row statistics; bonus
tokens). Random numbers come from ``generator`` (in the kernel: Philox keyed by it), so seeded
runs reproduce; tests hold both paths to the same decisions on the same uniforms.

Log-probabilities. Every emitted token (accepted or bonus) reports ``log p(token)`` under the
distribution it was drawn from at its parent: temperature-scaled, top-k/top-p truncated and
renormalised (for greedy, the log-softmax of the raw logits). The residual used for the bonus is
a device of the rejection scheme, not the policy, so it is never reported. With an empty
DraftBatch, ``verify`` is plain sampling and reports the same numbers.
"""
from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from rollout_spec.config import SamplingParams
from rollout_spec.sampling import (
    RowStats,
    SamplingTable,
    effective_temperature,
    row_stats,
    target_scores_of_rows,
)
from rollout_spec.tree import DraftBatch, TreeInputs, to_device

# A child holding all the mass not yet rejected is accepted with certainty; float rounding of
# that remaining mass must not turn certainty into a rare rejection with nothing left to sample.
_CERTAIN = 1.0 - 1e-6
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
    parent: np.ndarray  # int64[N]: flat index of the parent node, -1 under the root
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
                      parent=np.where(par >= 0, starts[req] + par, -1),
                      parent_row=root_row[req] + 1 + par, node_row=root_row[req] + 1 + local,
                      root_row=root_row)


def verify(
    logits: torch.Tensor,
    batch: DraftBatch,
    sampling: SamplingParams | Sequence[SamplingParams],
    generator: torch.Generator | None = None,
    *,
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
        generator: torch.Generator on the logits' device; seeded runs reproduce.
        tree: the TreeInputs of this forward; optional, only checked against the batch (the
            walk needs nothing that the batch does not already hold on the host).
        backend: "triton" (the whole walk in one kernel, verify_triton.py), "torch" (the
            reference: torch row statistics, numpy walk) or "auto" (triton on CUDA when it is
            installed). Same law and logprobs; the random streams differ (seeded runs
            reproduce within a backend).
        on_walk: triton backend only: called once with ``VerifyResult.walk`` (the walk's
            device rows) when its final values are queued, before the host waits for them --
            the engine queues its KV compaction there, so the GPU runs it without a host gap.
    Returns:
        VerifyResult (numpy arrays in ``.host``, device tensors on access).
    Raises:
        ValueError/TypeError naming the offending argument or field.
    """
    table = _check_inputs(logits, batch, sampling, tree)
    if use_triton(backend, logits.device):
        from rollout_spec.verify_fused import verify_fused

        return VerifyResult(*verify_fused(logits, batch, table, generator, tree, on_walk=on_walk),
                            device=logits.device)
    return VerifyResult(verify_torch(logits, batch, table, generator), device=logits.device)


def verify_torch(logits: torch.Tensor, batch: DraftBatch, table: SamplingTable,
                 generator: torch.Generator | None,
                 noise: tuple[torch.Tensor, torch.Tensor] | None = None) -> HostVerifyResult:
    """The reference path for validated inputs: row statistics with torch, the walk in numpy.

    ``noise`` (tests only) replaces the draws from ``generator``: uniforms per node [N] and per
    row and token [R, V] (the bonus race of a final row r uses row r), as verify_triton takes.
    """
    dev, nodes = logits.device, _Nodes.of(batch)
    temps = effective_temperature(table)
    rows_per_req = batch.sizes() + 1
    temp_rows = None if table.uniform else np.repeat(temps, rows_per_req)
    uploads = [nodes.parent_row, nodes.tok] + ([temp_rows] if temp_rows is not None else [])
    dev_arrays = to_device(uploads, dev)
    stats = row_stats(logits, table, rows_per_req, table.any_greedy,
                      dev_arrays[2] if temp_rows is not None else None)
    child_logit = logits[dev_arrays[0], dev_arrays[1]].float()
    u = noise[0] if noise is not None else torch.rand(batch.num_nodes, generator=generator,
                                                      device=dev)
    child_logit, lse, thr, argmax, u = _fetch([child_logit, stats.lse, stats.thr, stats.argmax, u])
    logp = _node_logprobs(nodes, temps, child_logit, lse, thr)
    by_parent = np.argsort(nodes.parent_row, kind="stable")  # sibling groups, in slice order
    hit = _hits(nodes, by_parent, table.temperature == 0, logp, argmax, u)
    accepted = _on_path(nodes, _first_per_parent(nodes, by_parent, hit))
    final_row, acc_idx = _final_rows(nodes, accepted, batch.num_requests)
    bonus, bonus_score = _bonus(logits, stats, table, temps, nodes, final_row, generator,
                                noise[1] if noise is not None else None)
    bonus_logp = bonus_score - lse[final_row]
    return _assemble(nodes, acc_idx, logp, bonus, bonus_logp, batch.num_requests)


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(backend: str, device: torch.device) -> bool:
    """Resolve ``backend``: "triton" (the fused kernel; an error without triton), "torch" (the
    reference) or "auto" (triton on CUDA when it is installed)."""
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        return False
    if not _triton_installed():
        if backend == "triton":
            raise ImportError("backend='triton' needs the triton package (pip install triton)")
        return False
    return True


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


def _group_exclusive_cumsum(values: np.ndarray, keys: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Sum of ``values`` over the earlier members (in ``order``) of each element's key group."""
    v = values[order]
    k = keys[order]
    before = np.cumsum(v) - v
    is_start = np.ones(len(k), bool)
    is_start[1:] = k[1:] != k[:-1]
    start = np.maximum.accumulate(np.where(is_start, np.arange(len(k)), 0))
    out = np.empty_like(before)
    out[order] = before - before[start]
    return out


def _hits(nodes: _Nodes, by_parent: np.ndarray, greedy: np.ndarray, logp: np.ndarray,
          argmax: np.ndarray | None, u: np.ndarray) -> np.ndarray:
    """bool[N]: the node would be accepted if its parent were reached and earlier siblings
    rejected (duplicates of an earlier sibling's token never are). ``by_parent`` orders the
    nodes by parent row, stably."""
    by_token = np.lexsort((nodes.tok, nodes.parent_row))
    same = np.zeros(len(by_token), bool)
    same[1:] = (nodes.parent_row[by_token][1:] == nodes.parent_row[by_token][:-1]) & (
        nodes.tok[by_token][1:] == nodes.tok[by_token][:-1])
    dup = np.empty_like(same)
    dup[by_token] = same
    p = np.where(dup, 0.0, np.exp(logp.astype(np.float64)))
    left = np.maximum(1.0 - _group_exclusive_cumsum(p, nodes.parent_row, by_parent), 0.0)
    hit = (p > 0) & ((u * left < p) | (p >= left * _CERTAIN))
    node_greedy = greedy[nodes.req]
    if argmax is not None and node_greedy.any():
        hit = np.where(node_greedy, nodes.tok == argmax[nodes.parent_row], hit)
    return hit & ~dup


def _first_per_parent(nodes: _Nodes, by_parent: np.ndarray, hit: np.ndarray) -> np.ndarray:
    """bool[N]: the node is the first hit among its siblings (the child the walk would take)."""
    earlier = _group_exclusive_cumsum(hit.astype(np.int64), nodes.parent_row, by_parent)
    return hit & (earlier == 0)


def _on_path(nodes: _Nodes, chosen: np.ndarray) -> np.ndarray:
    """bool[N]: the node and all its ancestors were chosen (pointer jumping over parents)."""
    acc, up = chosen.copy(), nodes.parent.copy()
    while (up >= 0).any():  # log2(depth) rounds: ``up`` jumps 1, 2, 4, ... levels at a time
        has = up >= 0
        acc &= np.where(has, acc[np.maximum(up, 0)], True)
        up = np.where(has, up[np.maximum(up, 0)], -1)
    return acc


def _final_rows(nodes: _Nodes, accepted: np.ndarray, num_req: int) -> tuple[np.ndarray, np.ndarray]:
    """Verify row of each request's last accepted node (its root when none), and the flat
    indices of accepted nodes. A path's deepest node is its latest in topological order."""
    acc_idx = np.flatnonzero(accepted)
    last = np.full(num_req, -1, np.int64)
    np.maximum.at(last, nodes.req[acc_idx], acc_idx)
    final_row = nodes.root_row.copy()
    final_row[last >= 0] = nodes.node_row[last[last >= 0]]
    return final_row, acc_idx


def _bonus(logits: torch.Tensor, stats: RowStats, table: SamplingTable, temps: np.ndarray,
           nodes: _Nodes, final_row: np.ndarray, generator: torch.Generator | None,
           race_noise: torch.Tensor | None) -> tuple[np.ndarray, np.ndarray]:
    """Bonus tokens (int64[B]) and their masked scaled logits (float32[B]), from the final rows.

    Sampling uses the Gumbel race: argmax of ``log p(x) + G_x`` with ``G_x = -log(-log U_x)`` is a
    draw from p, and removing the final node's children (all rejected) from the race
    renormalises p over the rest. U in [0, 1) makes G finite or -inf, never +inf, so a draw never
    lands outside p's support. Greedy requests take the argmax: a child equal to it would have
    been accepted.
    """
    child = nodes.parent_row == final_row[nodes.req]
    greedy = table.temperature == 0
    ups = [final_row, nodes.req[child], nodes.tok[child]]
    if not table.uniform:
        ups += [temps.reshape(-1, 1), greedy]
    dev = to_device(ups, logits.device)
    temp = stats.temp if table.uniform else dev[3]
    scores = target_scores_of_rows(logits, stats, dev[0], temp)
    if table.any_sampling:
        u = (race_noise[dev[0]] if race_noise is not None
             else torch.rand(scores.shape, generator=generator, device=scores.device))
        race = scores - (-u.log()).log()
        race[dev[1], dev[2]] = float("-inf")
        bonus = race.argmax(dim=-1)
        if table.any_greedy:
            bonus = torch.where(dev[4], scores.argmax(dim=-1), bonus)
    else:
        bonus = scores.argmax(dim=-1)
    bonus_score = scores.gather(1, bonus[:, None]).squeeze(1)
    bonus_h, score_h = _fetch([bonus, bonus_score])
    return bonus_h, score_h


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

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
on the accepted path iff it and all its ancestors were their parent's first accepted child, which
is one reduction over the tree mask. No loop runs over requests, nodes or depth.

Log-probabilities. Every emitted token (accepted or bonus) reports ``log p(token)`` under the
distribution it was drawn from at its parent: temperature-scaled, top-k/top-p truncated and
renormalised (for greedy, the log-softmax of the raw logits). The residual used for the bonus is
a device of the rejection scheme, not the policy, so it is never reported. With an empty
DraftBatch, ``verify`` is plain sampling and reports the same numbers.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from rollout_spec.config import SamplingParams
from rollout_spec.sampling import SamplingTable, target_scores
from rollout_spec.tree import DraftBatch, TreeInputs, build_tree_inputs

# A child holding all the mass not yet rejected is accepted with certainty; float rounding of
# that remaining mass must not turn certainty into a rare rejection with nothing left to sample.
_CERTAIN = 1.0 - 1e-6


@dataclass(frozen=True)
class VerifyResult:
    """Per-request outcome of one verify step, as CSR tensors on the logits' device."""

    accepted_offsets: torch.Tensor  # int64[B+1]
    accepted_nodes: torch.Tensor  # int64[sum]; node indices within the slice, root to leaf
    bonus: torch.Tensor  # int64[B]; the token drawn after the accepted path
    emitted_offsets: torch.Tensor  # int64[B+1]
    emitted_tokens: torch.Tensor  # int64[sum]; accepted tokens then the bonus
    emitted_logprobs: torch.Tensor  # float32[sum]; log p(token) under its sampling distribution
    num_accepted: torch.Tensor  # int64[B]; length of the accepted path


def verify(
    logits: torch.Tensor,
    batch: DraftBatch,
    sampling: SamplingParams | Sequence[SamplingParams],
    generator: torch.Generator | None = None,
    *,
    tree: TreeInputs | None = None,
) -> VerifyResult:
    """Accept a path of every request's draft tree and draw one bonus token after it.

    Args:
        logits: [B + N, V] target logits, one row per root and node, request b's root at row
            ``offsets[b] + b`` followed by its nodes in slice order.
        batch: the draft trees the logits were computed for.
        sampling: one SamplingParams for all requests, or B of them.
        generator: torch.Generator on the logits' device; seeded runs reproduce.
        tree: the TreeInputs built for this forward (saves rebuilding the index tensors).
    Returns:
        VerifyResult; computing its CSR sizes costs one device synchronisation.
    Raises:
        ValueError/TypeError naming the offending argument or field.
    """
    table = _check_inputs(logits, batch, sampling, tree)
    num_req, dev = batch.num_requests, logits.device
    if tree is None:
        zeros = torch.zeros(num_req, dtype=torch.int64)
        tree = build_tree_inputs(batch, zeros, zeros, device=dev)
    scores, lse = target_scores(logits, table, batch.sizes() + 1)
    width = tree.width
    node = tree.parent_col >= 0  # real draft nodes: excludes roots and padding
    parent_rows = tree.row_index.gather(1, tree.parent_col.clamp(min=0))
    tok = tree.input_ids
    logp = scores[parent_rows, tok] - lse[parent_rows]  # [B, W] log p_parent(token)
    greedy = _request_flags(table.temperature == 0, dev)
    first = _first_accepted_child(scores, parent_rows, logp, tree, node, greedy, generator)
    # On the path iff every ancestor-or-self column (the root counts as accepted) was chosen.
    chosen = first.clone()
    chosen[:, 0] = True
    accepted = node & ~(tree.tree_mask & ~chosen[:, None, :]).any(dim=-1)
    num_accepted = accepted.sum(dim=1)
    final_col = (tree.depth * accepted).argmax(dim=1)  # deepest accepted node, else the root
    final_row = tree.row_index.gather(1, final_col[:, None]).squeeze(1)
    is_child = node & (tree.parent_col == final_col[:, None])
    bonus = _bonus_tokens(scores[final_row], tok, is_child, greedy, generator)
    bonus_logp = scores[final_row, bonus] - lse[final_row]
    return _assemble(accepted, num_accepted, tree.depth, tok, logp, bonus, bonus_logp, width)


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
    if not logits.is_floating_point() or logits.shape[1] < 1:
        raise ValueError(f"logits must be floating point with V >= 1, got {logits.dtype}")
    if batch.num_nodes and int(batch.tokens.max()) >= logits.shape[1]:
        raise ValueError(
            f"DraftBatch.tokens must be < V={logits.shape[1]}, got {int(batch.tokens.max())}"
        )
    if tree is not None:
        need = 1 + int(batch.sizes().max(initial=0))
        if tree.input_ids.shape[0] != batch.num_requests or tree.width < need:
            raise ValueError(
                f"tree must be built from this batch: [B, W>={need}] = "
                f"[{batch.num_requests}, >={need}], got {tuple(tree.input_ids.shape)}"
            )
        if tree.input_ids.device != logits.device:
            raise ValueError(f"tree is on {tree.input_ids.device}, logits on {logits.device}")
    return SamplingTable.from_params(sampling, batch.num_requests)


def _request_flags(flags: np.ndarray, device: torch.device) -> bool | torch.Tensor:
    """A per-request bool as a Python bool when uniform, else a [B, 1] tensor."""
    if not flags.any():
        return False
    if flags.all():
        return True
    return torch.from_numpy(flags).to(device)[:, None]


def _first_accepted_child(
    scores: torch.Tensor,
    parent_rows: torch.Tensor,
    logp: torch.Tensor,
    tree: TreeInputs,
    node: torch.Tensor,
    greedy: bool | torch.Tensor,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """bool[B, W]: the node is its parent's first accepted child (decisions drawn for all)."""
    width = tree.width
    pc, tok = tree.parent_col, tree.input_ids
    before = torch.ones(width, width, dtype=torch.bool, device=pc.device).tril(-1)
    earlier = (pc[:, :, None] == pc[:, None, :]) & node[:, None, :] & before  # earlier sibling
    dup = (earlier & (tok[:, :, None] == tok[:, None, :])).any(dim=-1)
    hit = torch.zeros_like(node)
    if greedy is not False:
        hit_greedy = tok == scores.argmax(dim=-1)[parent_rows]
        hit = hit_greedy if greedy is True else hit_greedy & greedy
    if greedy is not True:
        p = logp.exp().masked_fill(dup | ~node, 0.0)
        left = (1.0 - (earlier.to(p.dtype) * p[:, None, :]).sum(dim=-1)).clamp(min=0.0)
        # One draw per verify row, not per padded cell, so results do not depend on the width.
        u = torch.rand(scores.shape[0], generator=generator, device=p.device)[tree.row_index]
        hit_sample = (p > 0) & ((u * left < p) | (p >= left * _CERTAIN))
        hit = hit_sample if greedy is False else hit | (hit_sample & ~greedy)
    hit = hit & node & ~dup
    return hit & ~(earlier & hit[:, None, :]).any(dim=-1)


def _bonus_tokens(
    final_scores: torch.Tensor,
    tok: torch.Tensor,
    is_child: torch.Tensor,
    greedy: bool | torch.Tensor,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """int64[B]: the token after the accepted path, from p with the rejected children removed.

    Sampling uses the Gumbel race: argmax of ``log p(x) + G_x`` with ``G_x = -log(-log U_x)`` is a
    draw from p, and removing candidates from the race renormalises p over the rest. U in [0, 1)
    makes G finite or -inf, never +inf, so a draw can never land outside p's support.
    """
    if greedy is True:
        return final_scores.argmax(dim=-1)  # a child equal to the argmax would have been accepted
    vocab = final_scores.shape[1]
    u = torch.rand(final_scores.shape, generator=generator, device=final_scores.device)
    race = final_scores - (-u.log()).log()
    race = torch.nn.functional.pad(race, (0, 1), value=float("-inf"))
    race.scatter_(1, torch.where(is_child, tok, vocab), float("-inf"))
    sampled = race[:, :vocab].argmax(dim=-1)
    if greedy is False:
        return sampled
    return torch.where(greedy.squeeze(1), final_scores.argmax(dim=-1), sampled)


def _assemble(
    accepted: torch.Tensor,
    num_accepted: torch.Tensor,
    depth: torch.Tensor,
    tok: torch.Tensor,
    logp: torch.Tensor,
    bonus: torch.Tensor,
    bonus_logp: torch.Tensor,
    width: int,
) -> VerifyResult:
    """Pack the accepted paths and bonus tokens into CSR tensors (one device sync)."""
    num_req, dev = accepted.shape[0], accepted.device
    # An accepted node of depth d is the d-th emitted token; the rest go to a spill column.
    slot = torch.where(accepted, depth - 1, width)
    cols = torch.arange(width, device=dev).expand(num_req, width)
    em_tok = torch.zeros(num_req, width + 1, dtype=torch.int64, device=dev).scatter_(1, slot, tok)
    em_lp = torch.zeros(num_req, width + 1, dtype=torch.float32, device=dev)
    em_lp.scatter_(1, slot, logp.float())
    em_node = torch.zeros(num_req, width + 1, dtype=torch.int64, device=dev)
    em_node.scatter_(1, slot, cols - 1)
    em_tok.scatter_(1, num_accepted[:, None], bonus[:, None])
    em_lp.scatter_(1, num_accepted[:, None], bonus_logp.float()[:, None])
    keep = torch.arange(width + 1, device=dev) <= num_accepted[:, None]
    flat = keep.view(-1).nonzero().squeeze(1)  # the one synchronisation
    zero = torch.zeros(1, dtype=torch.int64, device=dev)
    acc_offsets = torch.cat([zero, num_accepted.cumsum(0)])
    em_offsets = torch.cat([zero, (num_accepted + 1).cumsum(0)])
    # Emitted entry t of request b that is not its bonus is accepted entry t - b.
    req = torch.div(flat, width + 1, rounding_mode="floor")
    is_bonus = flat - req * (width + 1) == num_accepted[req]
    total_acc = flat.numel() - num_req
    dest = torch.where(is_bonus, total_acc, torch.arange(flat.numel(), device=dev) - req)
    acc_nodes = torch.empty(total_acc + 1, dtype=torch.int64, device=dev)
    acc_nodes.scatter_(0, dest, em_node.view(-1)[flat])
    return VerifyResult(
        accepted_offsets=acc_offsets,
        accepted_nodes=acc_nodes[:total_acc],
        bonus=bonus,
        emitted_offsets=em_offsets,
        emitted_tokens=em_tok.view(-1)[flat],
        emitted_logprobs=em_lp.view(-1)[flat],
        num_accepted=num_accepted,
    )

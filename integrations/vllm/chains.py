"""Reduce draft trees to the single chains vLLM verifies, and name request groups.

vLLM's rejection sampler checks one chain of draft tokens per request. Siblings in a DraftBatch
are ordered best first, so the best root-to-leaf path follows the first child at every level.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from rollout_spec.config import check_int
from rollout_spec.groups import GROUP_ID_MAX, text_group_id
from rollout_spec.tree import DraftBatch

def best_chain(parents: Sequence[int], tokens: Sequence[int], max_len: int) -> list[int]:
    """Tokens of the first-child path of one request's tree slice, at most ``max_len`` long.

    Nodes are topologically ordered, so a node's first child is the first later index whose
    parent is that node: one forward scan finds the whole path.
    """
    chain: list[int] = []
    current = -1
    for i in range(len(parents)):
        if len(chain) >= max_len:
            break
        if parents[i] == current:
            chain.append(int(tokens[i]))
            current = i
    return chain


def best_chains(batch: DraftBatch, max_lens: Sequence[int]) -> list[list[int]]:
    """Best chain of every request in ``batch``; request b's chain has at most ``max_lens[b]``."""
    if len(max_lens) != batch.num_requests:
        raise ValueError(
            f"max_lens has {len(max_lens)} entries, the DraftBatch has {batch.num_requests} requests"
        )
    offsets = batch.offsets.tolist()
    tokens = batch.tokens.tolist()
    # a slice whose every parent is the node just before it is already a chain (tree=False
    # drafts always are): slice it instead of walking it
    sizes = batch.sizes()
    local = np.arange(batch.num_nodes) - np.repeat(batch.offsets[:-1].astype(np.int64), sizes)
    off_chain = np.concatenate([[0], np.cumsum(batch.parents != local - 1)]).tolist()
    # Python ints throughout the per-request loop: indexing numpy scalars there cost more than
    # slicing a chain; the parents are listed only when some slice is a tree
    parents = batch.parents.tolist() if off_chain[-1] else []
    out = []
    for b in range(batch.num_requests):
        lo, hi = offsets[b], offsets[b + 1]
        if off_chain[hi] == off_chain[lo]:
            cap = max_lens[b]
            out.append(tokens[lo:hi] if hi - lo <= cap else tokens[lo : lo + max(cap, 0)])
        else:
            out.append(best_chain(parents[lo:hi], tokens[lo:hi], max_lens[b]))
    return out


def explicit_group_id(value: Any) -> int:
    """Group id given by the caller in ``SamplingParams.extra_args``: a non-negative int is used
    as is, a string is hashed to a stable int.

    Raises:
        TypeError / ValueError: anything else, naming the extra_args key and the allowed forms.
    """
    if isinstance(value, str):
        return text_group_id(value)
    return check_int("extra_args['rollout_spec_group']", value, 0, GROUP_ID_MAX)

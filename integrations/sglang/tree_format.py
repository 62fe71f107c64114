"""Convert our CSR draft trees to SGLang's NGRAM format and back.

SGLang's NGRAM worker verifies, per request, a fixed-size tree of ``D = draft_token_num`` slots:
``ids[b, 0]`` is the request's last committed token (the root), the other slots are draft nodes
and ``mask[b, i, j] == 1`` iff slot j is slot i itself or one of its ancestors. Slots a drafter
did not fill hold token 0 and hang off the root, which is how SGLang's own corpus pads them.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from rollout_spec.tree import DraftBatch


def to_ids_mask(
    batch: DraftBatch, roots: Sequence[int], draft_token_num: int
) -> tuple[np.ndarray, np.ndarray]:
    """Lay out ``batch`` in SGLang's flat ``(ids int64[B*D], mask int64[B*D*D])`` form.

    Each request keeps its first ``D - 1`` nodes; nodes are in topological order, so a kept
    node's parent is always kept too.

    Raises:
        ValueError: ``roots`` does not have one token per request, or ``draft_token_num < 1``.
    """
    d = int(draft_token_num)
    if d < 1:
        raise ValueError(f"draft_token_num must be in [1, inf], got {d}")
    num = batch.num_requests
    if len(roots) != num:
        raise ValueError(f"roots has {len(roots)} tokens for a DraftBatch of {num} requests")
    ids = np.zeros((num, d), np.int64)
    mask = np.zeros((num, d, d), np.int64)
    ids[:, 0] = np.asarray(roots, np.int64)
    diag = np.arange(d)
    mask[:, diag, diag] = 1
    mask[:, :, 0] = 1
    sizes = np.minimum(batch.sizes(), d - 1)
    starts = batch.offsets[:-1].astype(np.int64)
    rows = np.arange(num)
    # Slot k+1 of every request at once: copy the parent's ancestor row, then add itself.
    for k in range(int(sizes.max(initial=0))):
        live = rows[sizes > k]
        node = starts[live] + k
        ids[live, k + 1] = batch.tokens[node]
        parent_slot = batch.parents[node].astype(np.int64) + 1
        mask[live, k + 1] = mask[live, parent_slot]
        mask[live, k + 1, k + 1] = 1
    return ids.reshape(-1), mask.reshape(-1)


def leaf_paths(tokens: Sequence[int], mask: Sequence[Sequence[int]]) -> list[list[int]]:
    """Root-to-leaf token paths of one request's ``(ids, mask)`` tree, in slot order.

    A slot is a leaf when no other slot has it as an ancestor. Used to compare trees whose
    sibling order is unspecified (SGLang's tests and ours compare sets of these paths).
    """
    m = np.asarray(mask, bool)
    n = len(tokens)
    if m.shape != (n, n):
        raise ValueError(f"mask must be {n}x{n} for {n} tokens, got shape {m.shape}")
    has_descendant = (m & ~np.eye(n, dtype=bool)).any(axis=0)
    return [[int(tokens[j]) for j in np.flatnonzero(m[i])] for i in range(n) if not has_descendant[i]]


def trim_padding(paths: list[list[int]], pad_token: int = 0) -> set[tuple[int, ...]]:
    """Leaf paths without SGLang's padding slots (a lone pad token under the root).

    A path ``[root, 0]`` is a padding slot; when every slot is padding the tree is the bare root.
    """
    kept = {tuple(p) for p in paths if not (len(p) == 2 and p[1] == pad_token)}
    if not kept and paths:
        kept = {(paths[0][0],)}
    return kept

"""The device KV compaction kernel against the host path's moves (KVCache.move).

Runs on a GPU when one is present, otherwise on CPU through triton's interpreter (conftest.py
sets it up before triton is imported). Skips when triton is not installed.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from triton_device import DEVICE  # skips the module where the kernels cannot run

from rollout_spec.engine.kv_cache import KVCache
from rollout_spec.engine.kv_compact import compact_accepted_kv


def random_paths(rng: np.random.Generator, num_req: int, width: int) -> list[list[int]]:
    """Per request an accepted path of tree columns: strictly increasing, within [1, width)."""
    paths = []
    for _ in range(num_req):
        depth = int(rng.integers(0, width))
        paths.append(sorted(rng.choice(np.arange(1, width), depth, replace=False).tolist()))
    return paths


def walk_rows(paths: list[list[int]], width: int) -> torch.Tensor:
    """int32 [B, 1 + 3W] as the fused walk writes them (count, columns, then unused fields)."""
    rows = np.full((len(paths), 1 + 3 * width), -7, np.int32)
    for b, cols in enumerate(paths):
        rows[b, 0] = len(cols)
        rows[b, 1 : 1 + len(cols)] = cols
    return torch.from_numpy(rows).to(DEVICE)


@pytest.mark.parametrize("heads,dim", [(3, 64), (2, 24)])
def test_kernel_moves_what_the_host_path_moves(heads: int, dim: int) -> None:
    """Random paths (chains from the first node, skips, none) in random slots: same cache."""
    rng = np.random.default_rng(heads * dim)
    layers, slots, max_len, width, num_req = 2, 6, 40, 9, 5
    ours = KVCache(layers, slots, heads, max_len, dim, torch.float32, DEVICE)
    ours.kv.copy_(torch.randn(ours.kv.shape, generator=torch.Generator().manual_seed(1)))
    theirs = KVCache(layers, slots, heads, max_len, dim, torch.float32, DEVICE)
    theirs.kv.copy_(ours.kv)
    before = ours.kv.clone()
    slot = rng.permutation(slots)[:num_req].astype(np.int64)
    ctx = rng.integers(0, max_len - width, num_req).astype(np.int64)
    paths = random_paths(rng, num_req, width)
    paths[0] = list(range(1, 5))  # accepted from the first node on: nothing moves
    paths[1] = [2, 3, 5]  # depth 1 takes column 2, which depth 2 reads first: order matters
    compact_accepted_kv(ours.kv, walk_rows(paths, width), torch.from_numpy(slot).to(DEVICE),
                        torch.from_numpy(ctx).to(DEVICE))
    moves = [(s, c + col, c + d) for s, c, cols in zip(slot, ctx, paths)
             for d, col in enumerate(cols, 1) if col != d]
    s, src, dst = (torch.tensor(m, device=DEVICE) for m in zip(*moves))
    theirs.move(s, src, dst)
    torch.testing.assert_close(ours.kv, theirs.kv, rtol=0, atol=0)
    assert not torch.equal(ours.kv, before)  # the moves were real


def test_bad_layout_is_refused() -> None:
    cache = KVCache(1, 2, 1, 8, 4, torch.float32, DEVICE)
    walk = torch.zeros(2, 7, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="contiguous"):
        compact_accepted_kv(cache.kv.transpose(4, 5), walk, walk[:, 0], walk[:, 0])


@pytest.mark.parametrize("field,bad,match", [
    ("kv", lambda c, w, s, x: (c.kv[0], w, s, x), r"kv must be a contiguous \[2, layers"),
    ("walk", lambda c, w, s, x: (c.kv, w.long(), s, x), r"walk must be a row-major int32"),
    # one slot for two walk rows: the kernel would read past it and move another slot's KV
    ("slots", lambda c, w, s, x: (c.kv, w, s[:1], x), r"slots must be an int \[2\] tensor"),
    ("ctx_lens", lambda c, w, s, x: (c.kv, w, s, x.float()), r"ctx_lens must be an int \[2\]"),
    ("slots", lambda c, w, s, x: (c.kv, w, s.to(torch.complex64), x), r"slots must be an int \[2\]"),
    ("ctx_lens", lambda c, w, s, x: (c.kv, w, s, x.to("meta")), r"ctx_lens is on meta"),
])
def test_bad_inputs_name_the_argument(field: str, bad, match: str) -> None:
    """Every argument the kernel cannot take is refused by name before the kernel runs."""
    cache = KVCache(1, 3, 1, 8, 4, torch.float32, DEVICE)
    cache.kv.copy_(torch.randn(cache.kv.shape))
    before = cache.kv.clone()
    walk = walk_rows([[2, 3], [1]], 3)
    slots = torch.tensor([2, 0], device=DEVICE)
    ctx = torch.tensor([1, 4], device=DEVICE)
    with pytest.raises(ValueError, match=match):
        compact_accepted_kv(*bad(cache, walk, slots, ctx))
    assert torch.equal(cache.kv, before)

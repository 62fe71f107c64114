"""The Triton tree-attention kernel against SDPA with an explicit mask.

Runs on a GPU when one is present, otherwise on CPU through triton's interpreter (conftest.py
sets it up before triton is imported). Skips when triton is not installed.
"""

from __future__ import annotations

import pytest
import torch

from triton_device import DEVICE  # skips the module where the kernels cannot run

from rollout_spec.engine import triton_attention as ta

DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
TOL = 2e-2 if DEVICE == "cuda" else 1e-4


def random_tree_mask(width: int, gen: torch.Generator) -> torch.Tensor:
    """Ancestor-or-self mask of a random tree whose nodes are in topological order."""
    mask = torch.zeros(width, width, dtype=torch.bool)
    for i in range(width):
        mask[i, i] = True
        if i > 0:
            parent = int(torch.randint(0, i, (1,), generator=gen)) if i > 1 else 0
            mask[i] |= mask[parent]
    return mask


def sdpa_reference(q, k_cache, v_cache, slot_ids, ctx_lens, tree_mask, scale):
    """Per-request SDPA over the slot's first ctx+W positions with an explicit boolean mask."""
    bsz, hq, width, dim = q.shape
    group = hq // k_cache.shape[1]
    out = torch.zeros(bsz, hq, width, dim, dtype=torch.float64)
    for b in range(bsz):
        ctx, slot = int(ctx_lens[b]), int(slot_ids[b])
        k = k_cache[slot, :, : ctx + width].double().repeat_interleave(group, dim=0)
        v = v_cache[slot, :, : ctx + width].double().repeat_interleave(group, dim=0)
        allowed = torch.cat([torch.ones(width, ctx, dtype=torch.bool), tree_mask[b].cpu()], dim=1)
        rows = allowed.any(dim=1)  # SDPA returns NaN on rows that see nothing; the contract says 0
        res = torch.nn.functional.scaled_dot_product_attention(
            q[b].double().cpu(), k.cpu(), v.cpu(), attn_mask=allowed, scale=scale)
        out[b, :, rows] = res[:, rows]
    return out


def make_case(bsz, hq, hkv, width, dim, ctx_list, slots, max_len, seed, tree=True):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(bsz, hq, width, dim, generator=gen)
    k_cache = torch.randn(slots, hkv, max_len, dim, generator=gen)
    v_cache = torch.randn(slots, hkv, max_len, dim, generator=gen)
    slot_ids = torch.randperm(slots, generator=gen)[:bsz].to(torch.int32)
    ctx_lens = torch.tensor(ctx_list, dtype=torch.int32)
    if tree:
        tree_mask = torch.stack([random_tree_mask(width, gen) for _ in range(bsz)])
    else:
        tree_mask = torch.rand(bsz, width, width, generator=gen) < 0.5
    return [t.to(DEVICE) for t in (q, k_cache, v_cache, slot_ids, ctx_lens, tree_mask)]


def check(case, scale, split_len=None):
    q, k_cache, v_cache, slot_ids, ctx_lens, tree_mask = case
    got = ta.tree_attention_triton(q.to(DTYPE), k_cache.to(DTYPE), v_cache.to(DTYPE),
                                   slot_ids, ctx_lens, tree_mask, scale, split_len=split_len)
    want = sdpa_reference(q.to(DTYPE), k_cache.to(DTYPE), v_cache.to(DTYPE),
                          slot_ids, ctx_lens, tree_mask, scale)
    assert got.shape == q.shape and got.dtype == DTYPE
    torch.testing.assert_close(got.double().cpu(), want, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("width", [1, 4, 7, 33])
@pytest.mark.parametrize("split_len", [64, None, 1024])
def test_gqa_tree_matches_sdpa(width, split_len):
    """SmolLM2's head layout (9 query heads over 3 kv heads), several splits or one."""
    ctx = [0, 5, 63, 64, 130, 200 - width]
    case = make_case(len(ctx), 9, 3, width, 64, ctx, slots=8, max_len=200, seed=width)
    check(case, 64 ** -0.5, split_len)


def test_arbitrary_mask_and_empty_rows_give_zeros():
    """Masks need not be trees; a row that sees no key (ctx=0, empty mask row) returns zeros."""
    case = make_case(3, 4, 2, 5, 32, [0, 17, 90], slots=3, max_len=128, seed=3, tree=False)
    case[5][0, 2] = False  # request 0 has no context: row 2 now sees nothing
    check(case, 0.3, split_len=64)


def test_decode_is_plain_attention_over_context():
    """W=1 with a self-visible root equals ordinary causal decode attention."""
    case = make_case(4, 8, 8, 1, 16, [1, 10, 77, 126], slots=5, max_len=128, seed=9)
    check(case, 0.25, split_len=64)


def test_choose_split_len_is_shape_only_and_aligned():
    """Small batches get many splits, large batches one; always a power-of-two multiple of 64."""
    small = ta.choose_split_len(1, 3, 2048, 132)
    large = ta.choose_split_len(256, 3, 2048, 132)
    assert small < large and large == 2048
    for s in (small, large, ta.choose_split_len(8, 3, 100, 132)):
        assert s % ta.BLOCK_N == 0 and s & (s - 1) == 0


@pytest.mark.parametrize("field,bad,message", [
    ("tree_mask", lambda c: c[5].float(), r"tree_mask must be bool \[2,2,2\]; got torch.float32"),
    ("slot_ids", lambda c: c[3][:1], r"slot_ids and ctx_lens must have shape \(2,\); got \(1,\)"),
    ("q", lambda c: c[0][:, :5], r"query heads \(5\) must be a multiple of kv heads \(3\)"),
])
def test_bad_inputs_raise(field, bad, message):
    """Shape and dtype errors name what is wrong before any kernel runs."""
    case = make_case(2, 6, 3, 2, 16, [3, 4], slots=2, max_len=64, seed=1)
    idx = {"q": 0, "slot_ids": 3, "tree_mask": 5}[field]
    case[idx] = bad(case)
    with pytest.raises(ValueError, match=message):
        ta.tree_attention_triton(*case, 0.25)


@pytest.mark.parametrize("split_len", [0, -64, 32])
def test_split_len_must_be_a_positive_multiple_of_block_n(split_len):
    """A zero or negative split length is refused by name, not a division by zero or an empty grid."""
    case = make_case(2, 6, 3, 2, 16, [3, 4], slots=2, max_len=64, seed=1)
    with pytest.raises(ValueError, match="split_len must be a positive multiple of 64"):
        ta.tree_attention_triton(*case, 0.25, split_len=split_len)


@pytest.mark.parametrize("field,bad,match", [
    ("slot_ids", lambda c: c[3].float(), "slot_ids must be an integer tensor"),
    ("ctx_lens", lambda c: c[4].to(torch.bool), "ctx_lens must be an integer tensor"),
    ("v_cache", lambda c: c[2].half(), "k_cache and v_cache must share a dtype"),
    ("ctx_lens", lambda c: c[4].to("meta"), "ctx_lens is on meta"),
])
def test_bad_dtypes_and_devices_name_the_input(field, bad, match):
    """Index tensors of a float dtype or on another device are refused before any kernel runs."""
    case = make_case(2, 6, 3, 2, 16, [3, 4], slots=2, max_len=64, seed=1)
    idx = {"v_cache": 2, "slot_ids": 3, "ctx_lens": 4}[field]
    case[idx] = bad(case)
    with pytest.raises(ValueError, match=match):
        ta.tree_attention_triton(*case, 0.25)


def test_backend_switch_and_dispatch_rules():
    """Dispatch takes the kernel only for CUDA steps whose G*W rows fit; bad names are refused."""
    q_small = torch.zeros(2, 9, 4, 64, device=DEVICE)
    q_wide = torch.zeros(2, 9, 50, 64, device=DEVICE)  # prefill-like: 3 x 50 = 150 rows > MAX_ROWS
    k = torch.zeros(3, 3, 64, 64, device=DEVICE)
    try:
        ta.set_backend("torch")
        assert not ta.should_dispatch(q_small, k)
        ta.set_backend("auto")
        assert ta.should_dispatch(q_small, k) == (DEVICE == "cuda")
        assert not ta.should_dispatch(q_wide, k)
        ta.set_backend("triton")
        if DEVICE == "cpu":
            with pytest.raises(RuntimeError, match="CUDA"):
                ta.should_dispatch(q_small, k)
        with pytest.raises(ValueError, match="backend"):
            ta.set_backend("flash")
    finally:
        ta.set_backend("auto")

"""Accepted draft KV moved onto its path positions by one kernel that reads the walk's result.

A verify forward writes node j of a request's tree at position ``ctx_len + 1 + j``; once the
walk has accepted a path, the d-th accepted node's keys and values belong at ``ctx_len + d``.
The host path (``ModelRunner.keep_accepted_kv``) builds those moves in numpy from the copied-back
result and uploads them, which costs 0.2-0.3 ms of host time per drafting step with the GPU
idle. Here the fused verification's device result (``verify_triton.launch_walk``'s rows: the
number accepted, then the accepted tree columns) drives the moves directly: one launch, no
host arrays. Program (b, k/v x layer) walks request b's accepted path in order, so a move never
reads a position an earlier move of the same path wrote (columns grow strictly along a path,
so the source of depth d' > d lies past the destination of depth d).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout_spec.engine.tensor_checks import check_same_device, is_integer_dtype


@triton.jit
def _compact_kernel(kv_ptr, walk_ptr, walk_stride, slot_ptr, ctx_ptr, stride_kl, stride_slot,
                    stride_head, stride_pos, HEADS: tl.constexpr, HPAD: tl.constexpr,
                    DIM: tl.constexpr, DPAD: tl.constexpr):
    b = tl.program_id(0)
    plane = tl.program_id(1).to(tl.int64)  # k or v of one layer
    row = walk_ptr + b * walk_stride
    accepted = tl.load(row)
    ctx = tl.load(ctx_ptr + b).to(tl.int64)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    heads = tl.arange(0, HPAD)[:, None]
    dims = tl.arange(0, DPAD)[None, :]
    cells = kv_ptr + plane * stride_kl + slot * stride_slot + heads * stride_head + dims
    keep = (heads < HEADS) & (dims < DIM)
    for depth in range(1, accepted + 1):
        src = ctx + tl.load(row + depth).to(tl.int64)  # column c holds node c-1 at ctx + c
        dst = ctx + depth
        if src != dst:  # a path accepted from the first node on is already in place
            values = tl.load(cells + src * stride_pos, mask=keep)
            tl.store(cells + dst * stride_pos, values, mask=keep)


def compact_accepted_kv(kv: torch.Tensor, walk: torch.Tensor, slots: torch.Tensor,
                        ctx_lens: torch.Tensor) -> None:
    """Move every request's accepted nodes' KV onto its path, in place.

    Args:
        kv: the cache ``[2, layers, slots, kv_heads, max_len, head_dim]`` (contiguous).
        walk: int32 ``[B, 1 + 3W]`` rows of the fused walk (accepted count, then columns).
        slots, ctx_lens: int ``[B]`` device tensors of the step (cached lengths before it).
    Raises:
        ValueError: a layout, dtype, shape or device the kernel cannot take. Nothing checks the
            values (that would sync the GPU); the kernel reads one slot and context length per walk
            row, so shorter ``slots`` or ``ctx_lens`` would make it move another slot's KV.
    """
    _check_inputs(kv, walk, slots, ctx_lens)
    two, layers, _, heads, _, dim = kv.shape
    num_req = walk.shape[0]
    if num_req == 0:
        return
    planes = kv.view(two * layers, *kv.shape[2:])
    _compact_kernel[(num_req, two * layers)](
        planes, walk, walk.stride(0), slots, ctx_lens, planes.stride(0), planes.stride(1),
        planes.stride(2), planes.stride(3), HEADS=heads, HPAD=triton.next_power_of_2(heads),
        DIM=dim, DPAD=triton.next_power_of_2(dim), num_warps=1,
    )


def _check_inputs(kv: torch.Tensor, walk: torch.Tensor, slots: torch.Tensor,
                  ctx_lens: torch.Tensor) -> None:
    """Raise ValueError naming the first argument the kernel cannot take as it is."""
    if kv.dim() != 6 or kv.shape[0] != 2 or not kv.is_contiguous():
        raise ValueError(f"kv must be a contiguous [2, layers, slots, kv_heads, max_len, head_dim] "
                         f"tensor, got shape {tuple(kv.shape)} (contiguous: {kv.is_contiguous()})")
    if walk.dim() != 2 or walk.stride(1) != 1 or walk.dtype != torch.int32:
        raise ValueError(f"walk must be a row-major int32 [B, 1 + 3W] tensor, got {walk.dtype} "
                         f"{tuple(walk.shape)}")
    for name, rows in (("slots", slots), ("ctx_lens", ctx_lens)):
        if tuple(rows.shape) != (walk.shape[0],) or not is_integer_dtype(rows.dtype):
            raise ValueError(f"{name} must be an int [{walk.shape[0]}] tensor (one per walk row), "
                             f"got {rows.dtype} {tuple(rows.shape)}")
    check_same_device(("kv", kv), (("walk", walk), ("slots", slots), ("ctx_lens", ctx_lens)))

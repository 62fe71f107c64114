"""Decode/verify attention over the static KV cache: the one entry point every layer calls.

The torch implementation here is the reference (and the CPU path); a fused GPU kernel may be
dispatched from ``tree_attention`` as long as it computes the same thing.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from rollout_spec.engine import triton_attention


# Prefill shapes change with every batch of prompts. cuDNN's attention builds a plan per new
# shape (80 ms to 1.2 s of host time on an H100) and, with a mask, still spent 1.8 ms of host
# time per call on repeats; flash attention has no per-shape set-up. CPU tensors take the math
# (or CPU flash) kernel.
_PREFILL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def prefill_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Causal attention of prompts over their own keys and values (nothing cached before them).

    ``q [B, Hq, T, D]``, ``k, v [B, Hkv, T, D]``; prompts are right-padded, so every real row
    sees exactly its prompt's earlier tokens. Key/value heads are repeated to the query heads
    because the fused kernels take GQA only that way.
    """
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    with sdpa_kernel(_PREFILL_BACKENDS):
        return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), is_causal=True,
                                              scale=scale)


def tree_visibility(ctx_lens: Tensor, tree_mask: Tensor, kv_len: int) -> Tensor:
    """Boolean mask ``[B, 1, W, kv_len]``: cached prefix plus tree ancestors among the new tokens.

    Cache position ``c`` is visible to new row ``i`` when ``c < ctx_len`` or when
    ``c = ctx_len + j`` with ``tree_mask[i, j]``.
    """
    B, W, _ = tree_mask.shape
    rel = torch.arange(kv_len, device=tree_mask.device)[None, :] - ctx_lens[:, None]  # [B, L]
    in_tree = (rel >= 0) & (rel < W)
    cols = rel.clamp(0, W - 1)[:, None, :].expand(B, W, kv_len)
    tree_part = torch.gather(tree_mask, 2, cols) & in_tree[:, None, :]
    return ((rel < 0)[:, None, :] | tree_part)[:, None]


def tree_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_ids: Tensor,
    ctx_lens: Tensor,
    tree_mask: Tensor,
    scale: float,
    kv_limit: Optional[int] = None,
) -> Tensor:
    """Attention of the step's W new queries per request over its slot of the cache.

    Args:
        q: ``[B, Hq, W, D]`` queries (RoPE applied).
        k_cache, v_cache: ``[S, Hkv, Lmax, D]`` one layer's cache; the step's W new keys/values
            are already written at positions ``ctx_len .. ctx_len+W-1`` of each request's slot.
        slot_ids, ctx_lens: ``[B]`` int64, the slot and cached length of each request.
        tree_mask: ``[B, W, W]`` bool, ancestor-or-self among the new tokens (causal for prefill).
        scale: softmax scale, usually ``D ** -0.5``.
        kv_limit: optional host-known bound on ``max(ctx_len) + W``; only that many cache
            positions are read. ``None`` reads all of ``Lmax`` (static shape, graph-friendly).
    Returns:
        ``[B, Hq, W, D]`` attention outputs in ``q``'s dtype.
    """
    if triton_attention.should_dispatch(q, k_cache):  # fused GPU kernel, same semantics
        return triton_attention.tree_attention_triton(
            q, k_cache, v_cache, slot_ids, ctx_lens, tree_mask, scale)
    kv_len = k_cache.shape[2] if kv_limit is None else min(kv_limit, k_cache.shape[2])
    k = k_cache[slot_ids, :, :kv_len]  # [B, Hkv, L, D]
    v = v_cache[slot_ids, :, :kv_len]
    mask = tree_visibility(ctx_lens, tree_mask, kv_len)
    return F.scaled_dot_product_attention(
        q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale, enable_gqa=True
    )

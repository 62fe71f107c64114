"""Static KV cache: one fixed-length row per request slot, for every layer.

Fixed shapes keep each step's forward free of allocations and host syncs (capturable in CUDA
graphs). Slot ``s`` holds one request's keys and values at positions ``0 .. ctx_len-1``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from rollout_spec.config import check_int


class KVCache:
    """Keys and values ``[layers, slots, kv_heads, max_len, head_dim]`` plus the moves the engine needs."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        sizes = {"num_layers": num_layers, "num_slots": num_slots, "num_kv_heads": num_kv_heads,
                 "max_len": max_len, "head_dim": head_dim}
        shape = tuple(check_int(f"KVCache {field}", value, 1) for field, value in sizes.items())
        num_slots, max_len = shape[1], shape[3]
        # One tensor, k and v its two halves: a move or prefix copy is one indexing op for both.
        self.kv = torch.zeros((2, *shape), dtype=dtype, device=device)
        self.k, self.v = self.kv[0], self.kv[1]
        self.num_slots, self.max_len = num_slots, max_len

    def write(
        self, layer: int, slot_ids: Tensor, ctx_lens: Tensor, k: Tensor, v: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Store the step's ``k, v [B, Hkv, W, D]`` at ``ctx_len .. ctx_len+W-1``; return the layer's cache.

        Padding columns are written too (their positions are overwritten by later steps before
        anyone may attend to them), which keeps the write shape static. Nothing here checks the
        positions (reading them would sync the host in every layer): the runner refuses a step
        whose ``ctx_len + W`` passes ``max_len`` before its forward.
        """
        W = k.shape[2]
        pos = ctx_lens[:, None] + torch.arange(W, device=k.device)  # [B, W]
        slots = slot_ids[:, None].expand_as(pos)
        k_layer, v_layer = self.k[layer], self.v[layer]
        # Advanced indices on dims 0 and 2 put (B, W) first: values are [B, W, Hkv, D].
        k_layer[slots, :, pos] = k.transpose(1, 2).to(k_layer.dtype)
        v_layer[slots, :, pos] = v.transpose(1, 2).to(v_layer.dtype)
        return k_layer, v_layer

    def move(self, slots: Tensor, src: Tensor, dst: Tensor) -> None:
        """Copy position ``src[i]`` to ``dst[i]`` of slot ``slots[i]`` in every layer.

        Used to pack accepted draft nodes onto their path positions. Every source is read (the
        indexed read makes a copy) before anything is written, so a destination may be another
        entry's source (a path with skips: columns 2, 3 move 2 -> 1 and 3 -> 2); destinations
        must be distinct.
        """
        self.kv[:, :, slots, :, dst] = self.kv[:, :, slots, :, src]

    def copy_prefix(self, src_slot: int, dst_slots: Tensor, length: int) -> None:
        """Copy the first ``length`` positions of one slot into others (n samples, one prefill).

        ``src_slot`` must be an integer in ``[0, num_slots - 1]`` and ``length`` one in
        ``[0, max_len]``: a slice past the cache would copy fewer positions than asked without any
        error.
        """
        src_slot = check_int("src_slot", src_slot, 0, self.num_slots - 1)
        length = check_int("length", length, 0, self.max_len)
        if dst_slots.numel() == 0 or length == 0:
            return
        self.kv[:, :, dst_slots, :, :length] = self.kv[:, :, src_slot : src_slot + 1, :, :length]

"""Triton tree attention for decode and verify steps (flash-decoding with a tree mask).

One program handles one (request, KV head, context split): it loads the query rows of every
query head of the GQA group and every draft position of the request (G*W rows) and streams that
KV head's keys and values once for all of them. The context is cut into splits so that a small
batch still fills the GPU; a second kernel merges the splits with their log-sum-exp. Decode is
the W=1 case of the same kernel.

Semantics match ``rollout_spec.engine.attention.tree_attention``: the step's W new K/V are already
in the cache at positions ctx_len..ctx_len+W-1 of the request's slot; query row i sees every cache
position below ctx_len plus the new positions j with tree_mask[b, i, j]. A row that sees nothing
returns zeros. Everything the kernels read is a device tensor with a fixed shape, so a call can be
captured in a CUDA graph.
"""

from __future__ import annotations

import os

import torch

from rollout_spec.engine.tensor_checks import check_same_device, is_integer_dtype

try:  # triton is optional: the engine runs on CPU without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None

BLOCK_N = 64  # keys per inner iteration; 64 x head_dim 64 x bf16 keeps K and V tiles in registers
_MIN_BLOCK_M = 16  # tl.dot needs at least 16 rows


MAX_ROWS = 128  # G*W query rows per program (W <= 42 at G = 3); wider steps (prefill) use torch
BACKENDS = ("auto", "torch", "triton")
_backend = os.environ.get("ROLLOUT_SPEC_ATTENTION", "auto")


def is_available() -> bool:
    """Whether triton is importable (the kernel itself also needs a CUDA tensor or TRITON_INTERPRET=1)."""
    return triton is not None


def set_backend(name: str) -> None:
    """Choose the attention backend: "auto" (triton for CUDA decode/verify), "torch" or "triton"."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {name!r}")
    _backend = name


def should_dispatch(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether ``attention.tree_attention`` should run this call through the Triton kernel.

    "auto" and "triton" take the kernel for CUDA tensors of a decode/verify step whose G*W rows
    fit one program (wide prefill steps use torch); "triton" raises where triton or CUDA is
    missing instead of quietly running torch.
    """
    if _backend not in BACKENDS:
        raise ValueError(f"ROLLOUT_SPEC_ATTENTION must be one of {BACKENDS}, got {_backend!r}")
    if _backend == "torch":
        return False
    group = q.shape[1] // k_cache.shape[1]
    dim = q.shape[3]
    fits = group * q.shape[2] <= MAX_ROWS and dim >= 16 and dim & (dim - 1) == 0
    runnable = triton is not None and q.is_cuda
    if _backend == "triton" and not runnable:
        raise RuntimeError(f"attention backend 'triton' needs triton and CUDA tensors (triton "
                           f"installed: {triton is not None}, cuda: {q.is_cuda})")
    return runnable and fits


if triton is not None:

    @triton.jit
    def _split_kernel(
        Q, K, V, SLOT, CTX, MASK, OUT, O_PART, LSE_PART,
        s_qb, s_qh, s_qw, s_ks, s_kh, s_kl, s_vs, s_vh, s_vl,
        s_mb, s_mi, s_ob, s_oh, s_ow, s_pb, s_ph, s_ps, s_pm,
        qk_scale, split_len,
        W: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr, IEEE: tl.constexpr,
    ):
        """Attention of all G*W query rows of one (request, kv head) over one context split."""
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        slot = tl.load(SLOT + b).to(tl.int64)
        ctx = tl.load(CTX + b).to(tl.int32)
        total = ctx + W
        rows = tl.arange(0, BLOCK_M)
        row_ok = rows < G * W
        g = rows // W  # query head within the group
        w = rows % W  # draft position of the row
        d = tl.arange(0, D)
        q_ptr = Q + b * s_qb + (kvh * G + g)[:, None] * s_qh + w[:, None] * s_qw + d[None, :]
        q = tl.load(q_ptr, mask=row_ok[:, None], other=0.0)
        k_base = K + slot * s_ks + kvh * s_kh
        v_base = V + slot * s_vs + kvh * s_vh
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        start = split * split_len
        end = tl.minimum(start + split_len, total)
        for n0 in range(start, end, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            col_ok = cols < total
            k = tl.load(k_base + cols[:, None] * s_kl + d[None, :], mask=col_ok[:, None], other=0.0)
            if IEEE:  # fp32 models get fp32 products; tl.dot would round fp32 inputs to TF32
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
            else:
                s = tl.dot(q, tl.trans(k)) * qk_scale  # log2 domain: scale already holds log2(e)
            # New positions are visible only along the tree mask; the context is visible to all.
            is_new = (cols >= ctx) & col_ok
            tm_ptr = MASK + b * s_mb + w[:, None] * s_mi + (cols - ctx)[None, :]
            tm = tl.load(tm_ptr, mask=row_ok[:, None] & is_new[None, :], other=0)
            visible = ((cols < ctx)[None, :] | (tm != 0)) & row_ok[:, None]
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # avoid inf - inf on empty rows
            p = tl.math.exp2(s - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + cols[:, None] * s_vl + d[None, :], mask=col_ok[:, None], other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        has = l_i > 0.0
        o = acc / tl.where(has, l_i, 1.0)[:, None]
        if DIRECT:
            o_ptr = OUT + b * s_ob + (kvh * G + g)[:, None] * s_oh + w[:, None] * s_ow + d[None, :]
            tl.store(o_ptr, o.to(OUT.dtype.element_ty), mask=row_ok[:, None])
        else:
            part = b * s_pb + kvh * s_ph + split * s_ps
            tl.store(O_PART + part * D + rows[:, None] * D + d[None, :], o)
            lse = tl.where(has, m_i + tl.math.log2(tl.where(has, l_i, 1.0)), float("-inf"))
            tl.store(LSE_PART + part + rows * s_pm, lse)

    @triton.jit
    def _merge_kernel(
        OUT, O_PART, LSE_PART, num_splits,
        s_ob, s_oh, s_ow, s_pb, s_ph, s_ps, s_pm,
        W: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
    ):
        """Combines the per-split partial outputs of one (request, kv head) by their log-sum-exp."""
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        rows = tl.arange(0, BLOCK_M)
        row_ok = rows < G * W
        d = tl.arange(0, D)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        for s in range(0, num_splits):
            part = b * s_pb + kvh * s_ph + s * s_ps
            lse = tl.load(LSE_PART + part + rows * s_pm)
            o = tl.load(O_PART + part * D + rows[:, None] * D + d[None, :])
            m_new = tl.maximum(m, lse)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.math.exp2(m - m_safe)
            beta = tl.math.exp2(lse - m_safe)
            l = l * alpha + beta
            acc = acc * alpha[:, None] + o * beta[:, None]
            m = m_new
        out = acc / tl.where(l > 0.0, l, 1.0)[:, None]
        g = rows // W
        w = rows % W
        o_ptr = OUT + b * s_ob + (kvh * G + g)[:, None] * s_oh + w[:, None] * s_ow + d[None, :]
        tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=row_ok[:, None])


def choose_split_len(batch: int, kv_heads: int, max_len: int, num_sms: int) -> int:
    """Context tokens per split: enough splits that batch*kv_heads*splits covers ~2 waves of SMs.

    It depends only on shapes (never on the live context lengths) so that a captured CUDA graph
    stays valid; splits past a request's context end exit at once.
    """
    programs = max(1, batch * kv_heads)
    want_splits = max(1, (2 * num_sms + programs - 1) // programs)
    split = max(BLOCK_N, -(-max_len // want_splits))
    split = 1 << (split - 1).bit_length()  # power of two, a multiple of BLOCK_N
    return min(split, max(BLOCK_N, 1 << (max_len - 1).bit_length()))


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # interpreter runs: a few splits, so the merge path is exercised


def _check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_ids: torch.Tensor, ctx_lens: torch.Tensor, tree_mask: torch.Tensor) -> None:
    """Raise ValueError naming the first input the kernels cannot take (shapes, dtypes, devices)."""
    if q.dim() != 4 or k_cache.dim() != 4:
        raise ValueError(f"q must be [B,Hq,W,D] and k_cache [S,Hkv,Lmax,D]; got {tuple(q.shape)}, "
                         f"{tuple(k_cache.shape)}")
    bsz, hq, width, dim = q.shape
    hkv = k_cache.shape[1]
    if v_cache.shape != k_cache.shape or k_cache.shape[3] != dim:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must match "
                         f"and end in head_dim={dim}")
    if hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
    if dim < 16 or dim & (dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {dim}")
    if tuple(slot_ids.shape) != (bsz,) or tuple(ctx_lens.shape) != (bsz,):
        raise ValueError(f"slot_ids and ctx_lens must have shape ({bsz},); got "
                         f"{tuple(slot_ids.shape)}, {tuple(ctx_lens.shape)}")
    if tuple(tree_mask.shape) != (bsz, width, width) or tree_mask.dtype != torch.bool:
        raise ValueError(f"tree_mask must be bool [{bsz},{width},{width}]; got "
                         f"{tree_mask.dtype} {tuple(tree_mask.shape)}")
    if q.stride(3) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("q, k_cache and v_cache must be contiguous in head_dim")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache and v_cache must share a dtype; got {k_cache.dtype}, {v_cache.dtype}")
    for name, rows in (("slot_ids", slot_ids), ("ctx_lens", ctx_lens)):
        if not is_integer_dtype(rows.dtype):
            raise ValueError(f"{name} must be an integer tensor, got {rows.dtype}")
    check_same_device(("q", q), (("k_cache", k_cache), ("v_cache", v_cache), ("slot_ids", slot_ids),
                                 ("ctx_lens", ctx_lens), ("tree_mask", tree_mask)))


def tree_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_ids: torch.Tensor, ctx_lens: torch.Tensor, tree_mask: torch.Tensor,
                          scale: float, split_len: int | None = None) -> torch.Tensor:
    """Tree attention for a padded (B, W) step; same contract as ``attention.tree_attention``.

    Args:
        q: [B, Hq, W, D] queries of the step's new positions.
        k_cache, v_cache: [S, Hkv, Lmax, D] caches; the step's K/V already sit at ctx..ctx+W-1.
        slot_ids: [B] int cache slot of each request. ctx_lens: [B] int committed context length.
        tree_mask: [B, W, W] bool; row i may see new position j where True.
        scale: softmax scale (usually head_dim ** -0.5).
        split_len: context tokens per split (a multiple of 64); None picks one from the shapes.
    Returns:
        [B, Hq, W, D] in q's dtype. Inputs are not checked against Lmax (that would sync the GPU):
        the caller guarantees ctx_len + W <= Lmax.
    """
    if triton is None:
        raise RuntimeError("tree_attention_triton needs the 'triton' package; it is not installed")
    _check_inputs(q, k_cache, v_cache, slot_ids, ctx_lens, tree_mask)
    bsz, hq, width, dim = q.shape
    hkv, max_len = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    block_m = max(_MIN_BLOCK_M, triton.next_power_of_2(group * width))
    if split_len is None:
        split_len = choose_split_len(bsz, hkv, max_len, _num_sms(q.device))
    if split_len < BLOCK_N or split_len % BLOCK_N:
        raise ValueError(f"split_len must be a positive multiple of {BLOCK_N}, got {split_len}")
    splits = -(-max_len // split_len)
    out = torch.empty_like(q)
    mask = tree_mask.contiguous().view(torch.uint8)
    direct = splits == 1
    part_shape = (bsz, hkv, splits, block_m)
    lse = torch.empty(part_shape if not direct else (1, 1, 1, 1), device=q.device, dtype=torch.float32)
    o_part = torch.empty((*part_shape, dim) if not direct else (1,), device=q.device, dtype=torch.float32)
    qk_scale = scale * 1.4426950408889634  # exp2/log2 domain
    _split_kernel[(bsz, hkv, splits)](
        q, k_cache, v_cache, slot_ids, ctx_lens, mask, out, o_part, lse,
        q.stride(0), q.stride(1), q.stride(2), *k_cache.stride()[:3], *v_cache.stride()[:3],
        mask.stride(0), mask.stride(1), out.stride(0), out.stride(1), out.stride(2),
        *(lse.stride() if not direct else (0, 0, 0, 0)),
        qk_scale, split_len,
        W=width, G=group, D=dim, BLOCK_M=block_m, BLOCK_N=BLOCK_N, DIRECT=direct,
        IEEE=q.dtype == torch.float32 and k_cache.dtype == torch.float32,
    )
    if not direct:
        _merge_kernel[(bsz, hkv)](
            out, o_part, lse, splits, out.stride(0), out.stride(1), out.stride(2), *lse.stride(),
            W=width, G=group, D=dim, BLOCK_M=block_m,
        )
    return out

"""Triton kernel for the one [rows, V] pass verification needs when nothing is truncated.

For every verify row it returns the log-normaliser of ``logits / T`` and the argmax of the raw
logits, reading each logit once (online log-sum-exp). torch's ``logsumexp`` makes about five
passes over the same [rows, V] float32 matrix (max, subtract, exp, sum), which dominates the
verification cost on a GPU. ``sampling.row_stats`` is the torch reference and the fallback;
tests/test_verify_triton.py checks this kernel against it (on CPU through TRITON_INTERPRET=1).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _row_stats_kernel(logits_ptr, stride, temp_ptr, temp_scalar, lse_ptr, argmax_ptr, vocab,
                      PER_ROW_TEMP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride
    if PER_ROW_TEMP:
        temp = tl.load(temp_ptr + row)
    else:
        temp = temp_scalar
    run_max = -float("inf")
    run_sum = 0.0
    best = -float("inf")
    best_idx = 0
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < vocab, other=-float("inf")).to(tl.float32)
        block_best = tl.max(x, axis=0)
        block_idx = tl.argmax(x, axis=0)
        # Strictly greater: ties keep the earliest index, as torch.argmax does.
        take = block_best > best
        best_idx = tl.where(take, start + block_idx, best_idx)
        best = tl.where(take, block_best, best)
        y = x / temp
        new_max = tl.maximum(run_max, tl.max(y, axis=0))
        # An all -inf prefix has nothing to rescale: anchor at 0 instead of producing NaN.
        anchor = tl.where(new_max == -float("inf"), 0.0, new_max)
        run_sum = run_sum * tl.exp(run_max - anchor) + tl.sum(tl.exp(y - anchor), axis=0)
        run_max = new_max
    lse = tl.where(run_max == -float("inf"), run_max, run_max + tl.log(run_sum))
    tl.store(lse_ptr + row, lse)
    tl.store(argmax_ptr + row, best_idx.to(tl.int64))


def row_lse_argmax(logits: torch.Tensor, temp: float | torch.Tensor, block: int = 4096
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """float32[R] logsumexp of ``logits / temp`` and int64[R] argmax of ``logits`` per row.

    ``temp`` is one float or float32[R] (or [R, 1]); ``logits`` is any float dtype, row-major.
    """
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    argmax = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return lse, argmax
    per_row = isinstance(temp, torch.Tensor)
    temp_t = temp.reshape(-1).float().contiguous() if per_row else lse  # unused when scalar
    block = min(block, triton.next_power_of_2(vocab))
    _row_stats_kernel[(rows,)](
        logits, logits.stride(0), temp_t, float(temp) if not per_row else 1.0, lse, argmax,
        vocab, PER_ROW_TEMP=per_row, BLOCK=block, num_warps=8 if block >= 2048 else 4,
    )
    return lse, argmax

"""Compiling the fused verify's kernel variants before a rollout times or needs them.

``verify_triton``'s walk and threshold kernels specialise on a few constexprs: the padded tree
width (WPAD), the sampling mode (per-request parameters, temperature scaling, truncation, the
sampling race) and the candidate list size (CPAD). Each new combination is a Triton compile of
seconds; met mid-rollout, it lands in one step (the H100 run saw 28 ms mean steps at B=1 from
it). ``warm_up`` runs verify once on a dummy chain tree for every width class the engine can
use under a sampling mode, and remembers the keys so later calls are free. This module imports
no Triton: on CPU it only computes the keys (which tests check).
"""
from __future__ import annotations

import numpy as np
import torch

from rollout_spec.sampling import TOP_P_CANDIDATES, SamplingTable
from rollout_spec.tree import DraftBatch


def _pow2(n: int) -> int:
    """The smallest power of two >= n (as ``triton.next_power_of_2``)."""
    return 1 << max(0, n - 1).bit_length()


def num_candidates(table: SamplingTable, vocab: int, limit: int) -> int | None:
    """How many of each row's largest logits decide its top-k/top-p cut; None past ``limit``
    (then verify_fused runs the exact, sorting path)."""
    sampling = table.temperature > 0
    top_k = np.where(sampling & (table.top_k > 0), np.minimum(table.top_k, vocab), vocab)
    k_cut = top_k < vocab
    need_p = bool((~k_cut & sampling & (table.top_p < 1)).any())
    # One more than the largest k: a tie of the k-th value continuing past the list shows.
    ncand = min(vocab, max(int(top_k[k_cut].max(initial=0)) + 1, TOP_P_CANDIDATES * need_p))
    return None if ncand > limit else ncand


def variant_keys(table: SamplingTable, vocab: int, width: int, limit: int = 4096) -> set[tuple]:
    """The kernel specialisations (constexpr values, as ``launch_walk``/``launch_thresholds``
    pass them) that verifying trees ``width`` columns wide under ``table`` launches.
    ``limit`` is verify_triton.MAX_CANDIDATES."""
    per_req = not table.uniform
    scale = per_req or float(table.temperature[0]) not in (0.0, 1.0)
    truncating = table.truncates(vocab)
    q = max(16, min(1024, _pow2(-(-vocab // 4))))
    keys = {("walk", q, max(2, _pow2(width)), per_req, scale, truncating, table.any_sampling)}
    ncand = num_candidates(table, vocab, limit) if truncating else None
    if ncand is not None:
        keys.add(("threshold", q, max(2, _pow2(ncand)), per_req, scale))
    return keys


def warm_up(table: SamplingTable, vocab: int, widths: list[int], device: torch.device,
            warmed: set[tuple], launch: bool = True) -> set[tuple]:
    """Compile every kernel variant that verifying trees of these ``widths`` under ``table``'s
    sampling mode needs: one verify of a dummy chain tree per width bringing keys not in
    ``warmed`` (a few tiny launches once compiled). Adds the keys to ``warmed``; returns the
    new ones. ``launch=False`` (CPU, torch backend) only records them. A private generator
    leaves the caller's random stream untouched."""
    new: set[tuple] = set()
    small = _distinct_rows(table)
    for width in sorted(set(widths)):
        keys = variant_keys(table, vocab, width) - warmed - new
        if not keys:
            continue
        new |= keys
        if launch:
            _dummy_verify(small, vocab, width, device)
    warmed |= new
    return new


def _dummy_verify(table: SamplingTable, vocab: int, width: int, device: torch.device) -> None:
    """One fused verify of a chain of ``width - 1`` nodes per request on random fp32 logits
    (the engine's logits dtype), which compiles that width's variants."""
    from rollout_spec.verify_fused import verify_fused

    num_req = len(table.temperature)
    offsets = (np.arange(num_req + 1) * (width - 1)).astype(np.int32)
    parents = np.tile(np.arange(-1, width - 2, dtype=np.int32), num_req)
    batch = DraftBatch(offsets, np.zeros(len(parents), np.int32), parents,
                       np.ones(len(parents), np.float32))
    logits = torch.randn(num_req * width, vocab, device=device, dtype=torch.float32)
    verify_fused(logits, batch, table, torch.Generator(device).manual_seed(0), None)


def _distinct_rows(table: SamplingTable) -> SamplingTable:
    """One row per distinct (temperature, top_k, top_p): the same variants, few dummy rows."""
    if table.uniform:
        return SamplingTable(table.temperature[:1], table.top_k[:1], table.top_p[:1], True)
    rows = sorted(set(zip(table.temperature.tolist(), table.top_k.tolist(), table.top_p.tolist())))
    temp, top_k, top_p = zip(*rows)
    return SamplingTable(np.array(temp, np.float32), np.array(top_k, np.int64),
                         np.array(top_p, np.float32), False)

"""Verification on the GPU in one Triton kernel: one program walks one request's draft tree.

``verify.py``'s torch path is the reference: it races every level's rows with torch and walks the
trees on the host, one device round trip per level. Here program b does the whole walk of
request b on the device. Starting at the root row it makes one pass over the row (log-normaliser
of the masked scaled logits, raw argmax, and the Gumbel race that samples the row's
distribution), then moves to the child whose token won the race (greedy: the argmax) or, when no
child carries it, emits the winner as the bonus. Rows off the accepted path are never read, so a
step reads about (accepted + 1) rows per request, in one launch, with one device-to-host copy of
the outcome.

Randomness: the race's uniforms are noise.py's keyed Philox draws, (request seed, row position,
column), computed here with the same layout, so the kernel and the reference race the same noise
and a request's draws do not depend on the step, the batch or the drafts. Tests may inject the
uniforms instead (``noise``).

Truncated rows (top-k/top-p) need their thresholds first: ``_threshold_kernel`` selects each
row's few largest logits itself (``_top_values``: two passes, no sort of the row; torch.topk
ranks them instead when top-p without top-k needs many) and computes the cut; a row whose cut
cannot be decided from its candidates is flagged, and the caller falls back to a full sort.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from rollout_spec.noise import NOISE_TAG as _NOISE_TAG, NoiseKeys, quarter_block

if os.environ.get("TRITON_INTERPRET") == "1":  # numpy runs the kernels, without libdevice

    @triton.jit
    def _precise_log1p(x):
        """log(1 + x), accurate for small x (Goldberg's form: the rounding of 1 + x cancels)."""
        w = 1.0 + x
        return tl.where(w == 1.0, x, tl.log(w) * x / (w - 1.0))

else:
    from triton.language.extra import libdevice

    @triton.jit
    def _precise_log1p(x):
        """log(1 + x), accurate for small x: exponential variates near 0 decide the race."""
        return libdevice.log1p(x)


@triton.jit
def _uniform(bits):
    """A Philox word as a uniform in (0, 1), as the host's race_noise.cpp converts it: its 31 bits
    as ``tl.uint_to_uniform_float`` takes them, at the middle of their cell."""
    x = bits.to(tl.int32, bitcast=True)
    x = tl.where(x < 0, -x - 1, x)
    return (x.to(tl.float32) + 0.5) * 4.6566127342e-10

# Kernel constants (constexpr: jitted code may only read constexpr globals).
NOISE_TAG = tl.constexpr(_NOISE_TAG)  # counter word 3 of the race's Philox calls (noise.py)
OUT_FIELDS = tl.constexpr(3)  # per request, W slots each: accepted column, emitted token, logprob
WALK_MIN_PAD = 64  # the walk's smallest padded width (see walk_pad)
MAX_CANDIDATES = 4096  # largest candidate list that _threshold_kernel ranks in one program


@triton.jit
def _scaled(row_ptr, cols, vocab, temp, thr, SCALE: tl.constexpr, HAS_THR: tl.constexpr):
    """Raw logits x at ``cols`` (-inf outside the vocabulary) and y = x / T, -inf below the
    truncation threshold."""
    x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    y = x
    if SCALE:  # IEEE division, bit-identical to torch's, so threshold comparisons agree
        y = tl.math.div_rn(x, temp)
    if HAS_THR:
        y = tl.where(y >= thr, y, float("-inf"))
    return x, y


@triton.jit
def _philox_words(k0, k1, c0, c1, c2, c3):
    """Philox-4x32-10 of counters (c0, c1, c2, c3) (uint32 vectors/scalars) under key (k0, k1)."""
    zero = (c1 * 0 + c0 * 0).to(tl.uint32)  # c0 or c1 may be a scalar or a constant
    return tl.philox_impl((zero + c0).to(tl.uint32), (zero + c1).to(tl.uint32), zero + c2,
                          zero + c3, k0, k1)


@triton.jit
def _absorb(m, s, best, bi, rbest, ri, row_ptr, noise_ptr, base, bits, vocab, temp, thr,
            Q: tl.constexpr, SCALE: tl.constexpr, HAS_THR: tl.constexpr, RACE: tl.constexpr,
            EXT_NOISE: tl.constexpr):
    """Fold columns [base, base + Q) of a row into per-lane running statistics: max m and sum
    s of an online log-sum-exp of y, best x and its column, best race value and its column.
    Lanes are reduced once per row (``_row_pass``): no cross-warp reduction inside the loop, so
    loads stream."""
    cols = base + tl.arange(0, Q)
    x, y = _scaled(row_ptr, cols, vocab, temp, thr, SCALE, HAS_THR)
    take = x > best  # strict: a lane keeps its earliest column on ties
    bi = tl.where(take, cols, bi)
    best = tl.where(take, x, best)
    new_m = tl.maximum(m, y)
    # One exp per element: the smaller of (m, y) relative to the new max; nothing kept: 0.
    e = tl.where(new_m == float("-inf"), 0.0, tl.exp(tl.minimum(m, y) - new_m))
    s = tl.where(y > m, s * e + 1.0, s + e)
    # A NaN logit poisons its lane's sum (kept through every later fold), so the row's
    # normaliser and logprobs come out NaN and verify refuses them; max and where skip NaNs.
    s = tl.where(x != x, float("nan"), s)
    if RACE:
        if EXT_NOISE:
            u = tl.load(noise_ptr + cols, mask=cols < vocab, other=0.5)
        else:
            u = _uniform(bits)
        ex = -_precise_log1p(-u)  # u in (0, 1): ex in (0, 16.7]; the race is max of y - log(ex)
        r = tl.where(y > float("-inf"), y - tl.log(ex), float("-inf"))
        take_r = r > rbest
        ri = tl.where(take_r, cols, ri)
        rbest = tl.where(take_r, r, rbest)
    return new_m, s, best, bi, rbest, ri


@triton.jit
def _first_max(values, cols):
    """(max, smallest column holding it) over lanes."""
    top = tl.max(values, axis=0)
    return top, tl.min(tl.where(values == top, cols, 2147483647), axis=0)


@triton.jit
def _row_pass(row_ptr, noise_ptr, k0, k1, pos, vocab, temp, thr, Q: tl.constexpr,
              SCALE: tl.constexpr, HAS_THR: tl.constexpr, RACE: tl.constexpr,
              EXT_NOISE: tl.constexpr):
    """One read of a row: (log-normaliser of the kept y, argmax of x, race winner).

    Race noise (noise.py's layout): the super-block of 4Q columns at ``start`` uses Philox
    counters (start / 4 + i, pos_lo, pos_hi, NOISE_TAG) under the request's key (k0, k1), word w
    feeding column start + w * Q + i."""
    m = tl.full([Q], float("-inf"), tl.float32)
    s = tl.zeros([Q], tl.float32)
    best = tl.full([Q], float("-inf"), tl.float32)
    bi = tl.zeros([Q], tl.int32)
    rbest = tl.full([Q], float("-inf"), tl.float32)
    ri = tl.zeros([Q], tl.int32)
    for start in range(0, vocab, 4 * Q):
        if RACE and not EXT_NOISE:  # one Philox call feeds four sub-blocks
            w0, w1, w2, w3 = _philox_words(k0, k1, start // 4 + tl.arange(0, Q),
                                           (pos & 0xFFFFFFFF).to(tl.uint32),
                                           ((pos >> 32) & 0xFFFFFFFF).to(tl.uint32), NOISE_TAG)
        else:
            w0 = tl.zeros([Q], tl.uint32)
            w1 = w0
            w2 = w0
            w3 = w0
        m, s, best, bi, rbest, ri = _absorb(m, s, best, bi, rbest, ri, row_ptr, noise_ptr, start,
                                            w0, vocab, temp, thr, Q, SCALE, HAS_THR, RACE,
                                            EXT_NOISE)
        m, s, best, bi, rbest, ri = _absorb(m, s, best, bi, rbest, ri, row_ptr, noise_ptr,
                                            start + Q, w1, vocab, temp, thr, Q, SCALE, HAS_THR,
                                            RACE, EXT_NOISE)
        m, s, best, bi, rbest, ri = _absorb(m, s, best, bi, rbest, ri, row_ptr, noise_ptr,
                                            start + 2 * Q, w2, vocab, temp, thr, Q, SCALE,
                                            HAS_THR, RACE, EXT_NOISE)
        m, s, best, bi, rbest, ri = _absorb(m, s, best, bi, rbest, ri, row_ptr, noise_ptr,
                                            start + 3 * Q, w3, vocab, temp, thr, Q, SCALE,
                                            HAS_THR, RACE, EXT_NOISE)
    top = tl.max(m, axis=0)
    anchor = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(tl.where((m == float("-inf")) & (s == s), 0.0, s * tl.exp(m - anchor)), axis=0)
    lse = tl.where(top == float("-inf"), top, top + tl.log(total))
    _, amax = _first_max(best, bi)
    _, ridx = _first_max(rbest, ri)
    return lse, amax, ridx


@triton.jit
def _pick(values, jj, j):
    """values[j] of a small vector (registers cannot be indexed by a runtime scalar)."""
    return tl.sum(tl.where(jj == j, values, 0), axis=0)


@triton.jit
def _accepted_child(row_ptr, toks, kids, jj, lse, winner, vocab, temp, thr, WPAD: tl.constexpr,
                    SCALE: tl.constexpr, HAS_THR: tl.constexpr):
    """(column of the first child carrying the row's sampled token ``winner``, or WPAD; the
    children's logprobs) at the current row."""
    kx, ky = _scaled(row_ptr, tl.where(kids, toks, 0), vocab, temp, thr, SCALE, HAS_THR)
    klogp = tl.where(kids, ky - lse, 0.0)
    hit = kids & (toks == winner)
    return tl.min(tl.where(hit, jj, WPAD), axis=0), klogp


@triton.jit
def _request_key(seed_ptr, b):
    """Philox key words (k0, k1) of request b's seed."""
    seed = tl.load(seed_ptr + b)
    return (seed & 0xFFFFFFFF).to(tl.uint32), ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)


# The tree width changes from call to call: specialising on it (== 1, % 16) would compile the
# kernels again in the middle of a rollout.
@triton.jit(do_not_specialize=["width"])
def _row_stats_kernel(logits_ptr, stride_row, pcol_ptr, rowidx_ptr, width, temp_scalar, thr_ptr,
                      noise_ptr, seed_ptr, pos_ptr, stats_ptr, vocab, Q: tl.constexpr,
                      SCALE: tl.constexpr, HAS_THR: tl.constexpr, RACE: tl.constexpr,
                      EXT_NOISE: tl.constexpr):
    """Program (b, c) makes the walk's first pass over the row of request b's column c, if it
    holds a node (``_row_pass``, one temperature for all rows), and stores (lse as float32
    bits, argmax, race winner) at ``stats[row]``: the same code on the same inputs (the row's
    position is the root's plus the column's depth), so the walk reads exactly what its own pass
    would compute."""
    b = tl.program_id(0)
    c = tl.program_id(1)
    cell0 = b.to(tl.int64) * width
    if (c == 0) | (tl.load(pcol_ptr + cell0 + c) >= 0):
        row = tl.load(rowidx_ptr + cell0 + c)
        depth = 0
        up = c
        while up > 0:  # a few parent hops: columns are topological, parents come first
            up = tl.load(pcol_ptr + cell0 + up).to(tl.int32)
            depth += 1
        temp = tl.where(temp_scalar == 0.0, 1.0, temp_scalar)
        thr = -float("inf")
        if HAS_THR:
            thr = tl.load(thr_ptr + row)
        k0, k1 = _request_key(seed_ptr, b)
        pos = tl.load(pos_ptr + b) + depth
        lse, amax, ridx = _row_pass(logits_ptr + row * stride_row, noise_ptr + row * vocab, k0,
                                    k1, pos, vocab, temp, thr, Q, SCALE, HAS_THR, RACE, EXT_NOISE)
        tl.store(stats_ptr + row * 3, lse.to(tl.int32, bitcast=True))
        tl.store(stats_ptr + row * 3 + 1, amax)
        tl.store(stats_ptr + row * 3 + 2, ridx)


@triton.jit(do_not_specialize=["width"])
def _walk_kernel(logits_ptr, stride_row, tok_ptr, pcol_ptr, rowidx_ptr, width, temp_ptr,
                 temp_scalar, thr_ptr, noise_ptr, seed_ptr, pos_ptr, stats_ptr, out_ptr, vocab,
                 Q: tl.constexpr, WPAD: tl.constexpr, PER_REQ_TEMP: tl.constexpr,
                 SCALE: tl.constexpr, HAS_THR: tl.constexpr, RACE: tl.constexpr,
                 EXT_NOISE: tl.constexpr, PRE: tl.constexpr):
    """Program b walks request b's tree from its root row (module docstring): accepted
    columns, emitted tokens and their logprobs go to ``out`` (see ``launch_walk``). With PRE,
    each row's first pass was made by ``_row_stats_kernel`` and is read from ``stats``."""
    b = tl.program_id(0)
    k0, k1 = _request_key(seed_ptr, b)
    pos0 = tl.load(pos_ptr + b)
    if PER_REQ_TEMP:
        t_raw = tl.load(temp_ptr + b)
    else:
        t_raw = temp_scalar
    greedy = t_raw == 0.0
    temp = tl.where(greedy, 1.0, t_raw)
    jj = tl.arange(0, WPAD)
    live = jj < width
    cell0 = b.to(tl.int64) * width
    toks = tl.load(tok_ptr + cell0 + jj, mask=live, other=-1)
    pcols = tl.load(pcol_ptr + cell0 + jj, mask=live, other=-1)
    rows = tl.load(rowidx_ptr + cell0 + jj, mask=live, other=0)
    out = out_ptr + b.to(tl.int64) * (1 + OUT_FIELDS * width)
    cur = 0
    n = 0
    walking = True
    while walking:
        row = _pick(rows, jj, cur)
        row_ptr = logits_ptr + row * stride_row
        thr = -float("inf")
        if HAS_THR:
            thr = tl.load(thr_ptr + row)
        if PRE:
            lse = tl.load(stats_ptr + row * 3).to(tl.float32, bitcast=True)
            amax = tl.load(stats_ptr + row * 3 + 1)
            ridx = tl.load(stats_ptr + row * 3 + 2)
        else:
            lse, amax, ridx = _row_pass(row_ptr, noise_ptr + row * vocab, k0, k1, pos0 + n, vocab,
                                        temp, thr, Q, SCALE, HAS_THR, RACE, EXT_NOISE)
        winner = tl.where(greedy, amax, ridx)
        kids = (pcols == cur) & live
        first, klogp = _accepted_child(row_ptr, toks, kids, jj, lse, winner, vocab, temp, thr,
                                       WPAD, SCALE, HAS_THR)
        if first < WPAD:
            tl.store(out + 1 + n, first)
            tl.store(out + 1 + width + n, _pick(toks, jj, first).to(tl.int32))
            tl.store(out + 1 + 2 * width + n, _pick(klogp, jj, first).to(tl.int32, bitcast=True))
            n += 1
            cur = first
        else:
            bx, by = _scaled(row_ptr, winner, vocab, temp, thr, SCALE, HAS_THR)
            tl.store(out + 1 + width + n, winner.to(tl.int32))
            tl.store(out + 1 + 2 * width + n, (by - lse).to(tl.int32, bitcast=True))
            walking = False
    tl.store(out, n)


@triton.jit(do_not_specialize=["width", "ncand"])
def _threshold_kernel(logits_ptr, stride_row, cand_ptr, stride_c, ncand, pcol_ptr, rowidx_ptr,
                      width,
                      temp_ptr, temp_scalar, k_ptr, k_scalar, p_ptr, p_scalar, thr_ptr, flag_ptr,
                      vocab, Q: tl.constexpr, G: tl.constexpr, CPAD: tl.constexpr,
                      PER_REQ: tl.constexpr, SCALE: tl.constexpr, SELECT: tl.constexpr):
    """Truncation threshold of one verify row (program (b, column)) from its ``ncand`` largest
    raw logits, sorted: top-k's k-th largest scaled logit, then top-p's cut over the top-k set
    renormalised (sampling.py's law). When ties of the k-th value may continue past the
    candidates, the normaliser is taken over the whole row. Flags the row when the candidates
    cannot decide it: top-p without top-k whose mass among them does not reach top_p, or
    (SELECT) a selection that overflowed.

    SELECT: the candidates are selected here (``_top_values``, ``cand_ptr`` rows of CPAD
    floats are its scratch); otherwise they are read from ``cand_ptr`` (torch.topk's values)."""
    b = tl.program_id(0)
    c = tl.program_id(1)
    cell = b.to(tl.int64) * width + c
    if (c == 0) | (tl.load(pcol_ptr + cell) >= 0):
        row = tl.load(rowidx_ptr + cell)
        if PER_REQ:
            t_raw = tl.load(temp_ptr + b)
            k = tl.load(k_ptr + b)
            p = tl.load(p_ptr + b)
        else:
            t_raw = temp_scalar
            k = k_scalar
            p = p_scalar
        sampling = t_raw > 0.0
        temp = tl.where(sampling, t_raw, 1.0)
        k = tl.where(sampling & (k > 0) & (k < vocab), k, vocab)
        p = tl.where(sampling, p, 1.0)
        k_cut = k < vocab
        i = tl.arange(0, CPAD)
        inc = i < ncand
        row_ptr = logits_ptr + row * stride_row
        v, over = _candidates(row_ptr, cand_ptr + row * stride_c, ncand, vocab, Q, G, CPAD,
                              SELECT)
        y = v
        if SCALE:
            y = tl.math.div_rn(v, temp)
        thr_k = tl.where(k_cut, _pick(y, i, k - 1), -float("inf"))
        beyond = k_cut & (ncand < vocab) & (_pick(y, i, ncand - 1) >= thr_k)
        kept = inc & (y >= thr_k)
        ym = tl.max(tl.where(kept, y, -float("inf")), axis=0)
        lse = ym + tl.log(tl.sum(tl.where(kept, tl.exp(y - ym), 0.0), axis=0))
        if (k >= vocab) & (p < 1.0):  # the top-p mass is relative to the whole row
            lse, _, _ = _row_pass(row_ptr, logits_ptr, 0, 0, 0, vocab, temp, 0.0, Q, SCALE,
                                  False, False, False)
        if beyond & (p < 1.0):  # ties of the k-th value past the candidates count too
            lse, _, _ = _row_pass(row_ptr, logits_ptr, 0, 0, 0, vocab, temp, thr_k, Q, SCALE,
                                  True, False, False)
        # With that normaliser the cut is exact even then: if the candidates' mass stays below
        # top_p, only ties of the k-th value remain, so the cut is thr_k (max below).
        probs = tl.where(kept, tl.exp(y - lse), 0.0)
        mass = tl.cumsum(probs, axis=0)
        covered = k_cut | (p >= 1.0) | (ncand >= vocab) | (tl.max(mass, axis=0) >= p)
        keep_n = tl.maximum(tl.sum((inc & ((mass - probs) < p)).to(tl.int32), axis=0), 1)
        thr_p = tl.where(p < 1.0, _pick(y, i, keep_n - 1), -float("inf"))
        tl.store(thr_ptr + row, tl.maximum(thr_k, thr_p))
        tl.store(flag_ptr + row, ((~covered) | over).to(tl.int32))


@triton.jit
def _candidates(row_ptr, cand_row, ncand, vocab, Q: tl.constexpr, G: tl.constexpr,
                CPAD: tl.constexpr, SELECT: tl.constexpr):
    """(float32[CPAD]: the row's ``ncand`` largest raw logits sorted descending, -inf after;
    overflow flag): selected by ``_top_values`` (SELECT; ``cand_row`` is its scratch) or read
    from ``cand_row`` (torch.topk's values)."""
    i = tl.arange(0, CPAD)
    if SELECT:
        v, over = _top_values(row_ptr, cand_row, ncand, vocab, Q, G, CPAD)
        v = tl.where(i < ncand, v, float("-inf"))
    else:
        v = tl.load(cand_row + i, mask=i < ncand, other=float("-inf")).to(tl.float32)
        over = ncand < 0  # False, as a tensor: both branches return the same types
    return v, over


@triton.jit
def _top_values(row_ptr, scratch, ncand, vocab, Q: tl.constexpr, G: tl.constexpr,
                CAP: tl.constexpr):
    """(float32[CAP] whose first ``ncand`` entries are the row's ncand largest raw logits,
    sorted descending, as torch.topk's values, ties included; overflow flag). ``scratch``
    holds CAP floats of this program.

    Two passes instead of a sort of the row. Lane i keeps the largest of columns i, i + Q, ...;
    groups of Q / G lanes give G maxima of disjoint column sets, i.e. G distinct elements, so
    the ncand-th largest of them (ncand <= G), ``floor``, is at most the row's ncand-th largest
    value. Every element strictly above ``floor`` is gathered (usually barely more than ncand)
    and sorted; when fewer than ncand are, the rest of the top ncand are ties equal to
    ``floor``. More than CAP elements above ``floor`` (a pathological row) raise the overflow
    flag (the values are then wrong), and the caller falls back to an exact sort."""
    lanes = tl.arange(0, Q)
    lane_max = tl.full([Q], float("-inf"), tl.float32)
    for start in range(0, vocab, Q):
        cols = start + lanes
        x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        lane_max = tl.maximum(lane_max, x)
    group_max = tl.max(tl.reshape(lane_max, [G, Q // G]), axis=1)  # G elements: a cheaper sort
    floor = _pick(tl.sort(group_max, descending=True), tl.arange(0, G), ncand - 1)
    count = 0
    for start in range(0, vocab, Q):
        cols = start + lanes
        x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        above = (x > floor).to(tl.int32)
        slot = count + tl.cumsum(above, axis=0) - 1
        tl.store(scratch + slot, x, mask=(above != 0) & (slot < CAP))
        count += tl.sum(above, axis=0)
    tl.debug_barrier()  # the scratch was written by other threads of this program
    i = tl.arange(0, CAP)
    ordered = tl.sort(tl.load(scratch + i, mask=i < count, other=float("-inf")), descending=True)
    return tl.where(i < count, ordered, floor), count > CAP


@triton.jit(do_not_specialize=["ncand"])
def _top_values_kernel(logits_ptr, stride_row, buf_ptr, ncand, flag_ptr, vocab,
                       Q: tl.constexpr, G: tl.constexpr, CAP: tl.constexpr):
    """``_top_values`` of row ``program_id`` into ``buf[row, CAP:2 CAP]`` (its first CAP
    floats are scratch) and ``flag[row]``: lets tests hold the selection to torch.topk."""
    row = tl.program_id(0).to(tl.int64)
    vals, over = _top_values(logits_ptr + row * stride_row, buf_ptr + row * 2 * CAP, ncand, vocab,
                             Q, G, CAP)
    tl.store(buf_ptr + row * 2 * CAP + CAP + tl.arange(0, CAP), vals)
    tl.store(flag_ptr + row, over.to(tl.int32))


def _warps(q: int) -> int:
    """Warps per walk program: 16 at Q = 1024 (one element per thread and sub-block, 16 KB of
    loads in flight per iteration, 104 registers, no spills on sm_90), fewer for small rows."""
    return max(2, min(16, q // 64))


def walk_pad(width: int) -> int:
    """The walk's padded tree width: 64 for every tree the engine drafts up to budget 63, so one
    compiled variant per sampling mode serves every step. A width-dependent pad compiled a new
    variant (~1.3 s on an H100) the first time a step drafted at a new width class, inside the
    timed decode loop; the prefill's verify compiles the variant its decode steps use. Small
    batches draft up to 32 nodes (their verify tax stays flat), so the pad covers that width."""
    return max(WALK_MIN_PAD, triton.next_power_of_2(width))


def launch_walk(logits: torch.Tensor, tokens: torch.Tensor, parent_col: torch.Tensor,
                row_index: torch.Tensor, temp: float | torch.Tensor, thr: torch.Tensor | None,
                keys: NoiseKeys, out: torch.Tensor, race: bool,
                noise: torch.Tensor | None = None) -> None:
    """Walk every request's tree on the device; fills ``out`` int32[B, 1 + 3W] (row b: number
    accepted n, then W accepted columns, W emitted tokens, W emitted logprobs as float32 bits;
    the first n, n + 1, n + 1 slots are meaningful).

    ``tokens``/``parent_col``/``row_index`` are [B, W] as in TreeInputs; ``temp`` is one raw
    temperature or float32[B] (0 = greedy); ``thr`` float32[R] truncation thresholds or None;
    ``keys`` the requests' noise keys (noise.py); ``race`` is False only when every request is
    greedy; ``noise`` (tests) replaces the keyed draws with uniforms per row and token [R, V].

    A walk reads its rows one after another, each pass over the vocabulary waiting for the
    last. Where every row's pass fits in ``PRE_STATS_WAVES`` waves of one program per SM (small
    batches: B=8 with 32 drafts each is 264 rows), ``_row_stats_kernel`` makes all of them at
    once first, and the walk reads them; same figures, so same outcome.
    """
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    num_req, width = tokens.shape
    per_req = isinstance(temp, torch.Tensor)
    q = quarter_block(logits.shape[1])
    scale = per_req or float(temp) not in (0.0, 1.0)
    pre = width > 1 and not per_req and logits.shape[0] <= PRE_STATS_WAVES * _sm_count(logits.device)
    stats = out
    noise_arg = noise if noise is not None else out
    if pre:
        stats = torch.empty((logits.shape[0], 3), dtype=torch.int32, device=logits.device)
        _row_stats_kernel[(num_req, width)](
            logits, logits.stride(0), parent_col, row_index, width, float(temp),
            thr if thr is not None else out, noise_arg, keys.seeds, keys.positions, stats,
            logits.shape[1], Q=q, SCALE=scale, HAS_THR=thr is not None, RACE=race,
            EXT_NOISE=noise is not None, num_warps=_warps(q),
        )
    _walk_kernel[(num_req,)](
        logits, logits.stride(0), tokens, parent_col, row_index, width,
        temp if per_req else out, 0.0 if per_req else float(temp),
        thr if thr is not None else out, noise_arg, keys.seeds, keys.positions, stats, out,
        logits.shape[1], Q=q, WPAD=walk_pad(width), PER_REQ_TEMP=per_req, SCALE=scale,
        HAS_THR=thr is not None, RACE=race, EXT_NOISE=noise is not None, PRE=pre,
        num_warps=_warps(q),
    )


PRE_STATS_WAVES = 2  # most waves of row-stat programs (one per SM each) worth running up front


@functools.cache
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (the interpreter's CPU: 1)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


SELECT_MAX = 256  # most candidates _top_values ranks in one program (more: torch.topk)


def _select_shape(vocab: int, ncand: int) -> tuple[int, int, int] | None:
    """(Q, G, CAP) of ``_top_values`` for ``ncand`` candidates, or None when it cannot rank
    that many. Four times as many groups as candidates keeps collisions (two of the top values
    in one group) few, so the gathered set stays near ncand; CAP leaves room for them."""
    q = quarter_block(vocab)
    if not 1 <= ncand <= min(SELECT_MAX, q):
        return None
    cap = max(64, 4 * triton.next_power_of_2(ncand))
    return q, min(q, cap), cap


def can_select(vocab: int, ncand: int) -> bool:
    """Whether ``launch_thresholds`` can select ``ncand`` candidates itself (no torch.topk)."""
    return _select_shape(vocab, ncand) is not None


def top_values(logits: torch.Tensor, ncand: int, flags: torch.Tensor) -> torch.Tensor:
    """float32[R, >= ncand] whose first ``ncand`` columns are ``_top_values``' selection of
    every row, i.e. ``torch.topk(logits, ncand).values`` unless ``flags[r]`` is set (an
    overflow). The threshold kernel selects the same way inside; this exposes it to tests."""
    q, g, cap = _select_shape(logits.shape[1], ncand)
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    buf = torch.empty(logits.shape[0], 2 * cap, dtype=torch.float32, device=logits.device)
    _top_values_kernel[(logits.shape[0],)](logits, logits.stride(0), buf, ncand, flags,
                                           logits.shape[1], Q=q, G=g, CAP=cap, num_warps=_warps(q))
    return buf[:, cap:]


def launch_thresholds(logits: torch.Tensor, ncand: int, parent_col: torch.Tensor,
                      row_index: torch.Tensor, params: tuple, thr: torch.Tensor,
                      flags: torch.Tensor, candidates: torch.Tensor | None = None) -> None:
    """Fill ``thr`` float32[R] and ``flags`` int32[R] for every row of the batch from its
    ``ncand`` largest raw logits: selected inside the kernel when ``candidates`` is None (then
    ``can_select`` must hold), else read from ``candidates`` [R, >= ncand] (unit column stride,
    sorted descending: torch.topk's values). ``params`` is (temperature, top_k, top_p), each a
    scalar for all requests or a [B] tensor."""
    num_req, width = parent_col.shape
    vocab = logits.shape[1]
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    if candidates is None:  # the kernel's scratch: CAP floats per row
        q, g, cpad = _select_shape(vocab, ncand)
        candidates = torch.empty(logits.shape[0], cpad, dtype=torch.float32,
                                 device=logits.device)
    else:
        q, g, cpad = quarter_block(vocab), 1, max(2, triton.next_power_of_2(ncand))
    per_req = isinstance(params[0], torch.Tensor)
    scalars = (0.0, 0, 1.0) if per_req else (float(params[0]), int(params[1]), float(params[2]))
    ptrs = params if per_req else (thr, thr, thr)
    _threshold_kernel[(num_req, width)](
        logits, logits.stride(0), candidates, candidates.stride(0), ncand, parent_col, row_index,
        width, ptrs[0], scalars[0], ptrs[1], scalars[1], ptrs[2], scalars[2], thr, flags, vocab,
        Q=q, G=g, CPAD=cpad, PER_REQ=per_req, SCALE=per_req or scalars[0] not in (0.0, 1.0),
        SELECT=g > 1, num_warps=_warps(q),
    )

"""The fused walk kernel (verify_triton.py via verify_fused.py) against the torch reference.

Given the same uniforms (injected in place of the keyed draws, or the keyed draws themselves),
the kernel must take every decision the reference takes: same accepted nodes, bonus tokens and
logprobs, for greedy, sampling, truncation and mixed per-request parameters, duplicate siblings
and race winners no child carries. Runs on a GPU when one is present, otherwise on CPU through
triton's interpreter (conftest.py sets it up before triton is imported; CI runs it so). Skips when
triton is not installed. The law of the Philox draws is tested by test_verify_law.py with
ROLLOUT_SPEC_TEST_DEVICE=cuda.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from triton_device import DEVICE, INTERPRETED  # skips the module where the kernels cannot run

from rollout_spec import verify_fused as fused
from rollout_spec.config import SamplingParams
from rollout_spec.noise import NoiseKeys, quarter_block
from rollout_spec.sampling import SamplingTable
from rollout_spec.tree import DraftBatch, build_tree_inputs
from rollout_spec.verify import verify, verify_torch
from test_tree import random_batch

FIELDS = ("accepted_offsets", "accepted_nodes", "bonus", "emitted_offsets", "emitted_tokens",
          "num_accepted")
MIXED = [SamplingParams(temperature=0), SamplingParams(temperature=0.7),
         SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=1.3, top_p=0.6),
         SamplingParams(temperature=0.9, top_k=5, top_p=0.8)]
MODES = {
    "greedy": SamplingParams(temperature=0),
    "t1.0": SamplingParams(temperature=1.0),
    "t0.7": SamplingParams(temperature=0.7),
    "k3": SamplingParams(temperature=1.0, top_k=3),
    "p0.6": SamplingParams(temperature=1.3, top_p=0.6),
    "k5_p0.8": SamplingParams(temperature=0.9, top_k=5, top_p=0.8),
    "mixed": MIXED,
}
# A vocabulary over several lane blocks. Through the interpreter 60: Q = 16, all four sub-blocks
# of a row pass (the last one partly; 300 leaves the fourth empty) and four _top_values blocks,
# with 16 group maxima to sort instead of 64; compiled, 300 (Q = 128) as before.
WIDE = 60 if INTERPRETED else 300


def reference_thresholds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the interpreter, have verify_fused take its truncation thresholds from the
    reference (``_exact_thresholds``) instead of the threshold kernel, most of a truncating
    test's time there. For tests of the walk: the kernel's thresholds do not depend on it, and
    test_kernel_takes_the_reference_decisions[walk_passes-*] and the cut, candidate and fallback
    tests hold that kernel to the reference."""
    if INTERPRETED:
        monkeypatch.setattr(fused, "MAX_CANDIDATES", 0)  # every candidate list is too long


@pytest.fixture(params=[False, True], ids=["walk_passes", "pre_stats"])
def pre_stats(request, monkeypatch) -> bool:
    """Row passes made by the walk itself, or all of them first by ``_row_stats_kernel`` (then
    on the reference's thresholds through the interpreter: ``reference_thresholds``)."""
    from rollout_spec import verify_triton

    monkeypatch.setattr(verify_triton, "PRE_STATS_WAVES", 1 << 30 if request.param else 0)
    if request.param:
        reference_thresholds(monkeypatch)
    return request.param


def friendly_logits(batch: DraftBatch, vocab: int, seed: int) -> torch.Tensor:
    """Random logits whose parent rows mostly favour the drafted token (deep accepts): by 3 at
    V = 7, and by log(V / 7) more at larger V, so that it keeps its share of the row's mass."""
    gen = torch.Generator().manual_seed(seed)
    logits = 2 * torch.randn(batch.num_requests + batch.num_nodes, vocab, generator=gen)
    boost = 3.0 + max(0.0, math.log(vocab / 7))
    for b in range(batch.num_requests):
        lo = int(batch.offsets[b])
        for j in range(int(batch.sizes()[b])):
            if torch.rand((), generator=gen) < 0.7:
                logits[lo + b + int(batch.parents[lo + j]) + 1, batch.tokens[lo + j]] += boost
    return logits


def keys_of(num_req: int, seed: int) -> NoiseKeys:
    """Seeded noise keys at scattered root positions."""
    gen = torch.Generator().manual_seed(seed)
    return NoiseKeys(torch.randint(0, 2**62, (num_req,), generator=gen).to(DEVICE),
                     torch.randint(0, 3000, (num_req,), generator=gen).to(DEVICE))


def both_paths(logits, batch, params, seed, tree=None, keyed=False):
    """(kernel, reference) HostVerifyResults on the same injected uniforms (``keyed``: on
    the keyed draws both make themselves)."""
    table = SamplingTable.from_params(params, batch.num_requests)
    keys = keys_of(batch.num_requests, seed)
    noise = None if keyed else torch.rand(logits.shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    logits = logits.to(DEVICE)
    seen = []  # what on_walk's consumer (the engine's KV compaction) would read, when called
    host, walk = fused.verify_fused(logits, batch, table, keys, tree, noise=noise,
                                    on_walk=lambda rows: seen.append(rows.clone()))
    # Called once, on the final rows (after any redo of the walk); they say what the host says.
    assert len(seen) == 1 and torch.equal(seen[0], walk)
    np.testing.assert_array_equal(walk[:, 0].cpu().numpy(), host.num_accepted)
    return host, verify_torch(logits, batch, table, keys, noise=noise)


def assert_same(got, ref) -> None:
    for name in FIELDS:
        np.testing.assert_array_equal(getattr(got, name), getattr(ref, name), err_msg=name)
    np.testing.assert_allclose(got.emitted_logprobs, ref.emitted_logprobs, atol=2e-5)


@pytest.mark.parametrize("vocab", [7, WIDE])
@pytest.mark.parametrize("mode", list(MODES))
def test_kernel_takes_the_reference_decisions(mode, vocab, pre_stats):
    seed = list(MODES).index(mode) * 10 + vocab % 7
    batch = random_batch(np.random.default_rng(seed), num_req=6, max_size=5, vocab=6)
    params = MODES[mode]
    if isinstance(params, list):
        params = [params[b % len(params)] for b in range(batch.num_requests)]
    got, ref = both_paths(friendly_logits(batch, vocab, seed), batch, params, seed)
    assert_same(got, ref)


def test_race_winners_no_child_carries_are_the_bonus(pre_stats):
    """Wide roots on a flat row: many walks end at the root with a winner that none of its four
    children carries, and the kernel emits it as the reference does."""
    batch = DraftBatch.from_lists([[(t, -1) for t in range(4)]] * 12)  # wide roots, V=6
    logits = torch.zeros(batch.num_requests * 5, 6)
    got, ref = both_paths(logits, batch, SamplingParams(temperature=1.0), 3)
    assert_same(got, ref)
    assert (ref.num_accepted == 0).sum() >= 3  # several roots drew one of tokens 4, 5
    assert set(ref.bonus[ref.num_accepted == 0].tolist()) <= {4, 5}


@pytest.mark.parametrize("mode", ["t1.0", "k5_p0.8", "mixed"])
def test_kernel_draws_the_reference_keyed_noise(mode, pre_stats, monkeypatch):
    """Without injected uniforms both paths draw noise.py's keyed Philox uniforms (the kernel
    with its own Philox calls, the reference with torch): same decisions."""
    reference_thresholds(monkeypatch)
    batch = random_batch(np.random.default_rng(11), num_req=12, max_size=7, vocab=6)
    params = MODES[mode]
    if isinstance(params, list):
        params = [params[b % len(params)] for b in range(batch.num_requests)]
    got, ref = both_paths(friendly_logits(batch, WIDE, 11), batch, params, 11, keyed=True)
    assert_same(got, ref)


@pytest.mark.parametrize("case", ["flat_top_p", "ties_cut_by_top_k", "ties_then_top_p_inside"])
def test_cuts_the_candidates_cannot_see(case, monkeypatch):
    """Ties of the k-th value continuing past the candidates are counted in the normaliser by a
    pass over the row (no fallback); a top-p mass beyond the 1024 candidates (a flat row) falls
    back to the full sort. Either way the kernel decides as the reference."""
    calls = []
    exact = fused._exact_thresholds
    monkeypatch.setattr(fused, "_exact_thresholds", lambda *a: calls.append(1) or exact(*a))
    batch = random_batch(np.random.default_rng(4), num_req=3, max_size=3, vocab=6)
    rows = batch.num_requests + batch.num_nodes
    if case == "flat_top_p":  # 0.9 of the mass needs more than the 1024 candidates
        logits = 0.01 * torch.randn(rows, 1500, generator=torch.Generator().manual_seed(4))
        params = SamplingParams(temperature=1.0, top_p=0.9)
    else:  # the 5th largest value (0) ties with ~1500 others; three tokens stand above it
        logits = torch.zeros(rows, 1500)
        logits[:, 1:4] = 2.0 if case == "ties_cut_by_top_k" else 8.0
        params = SamplingParams(temperature=0.8, top_k=5, top_p=0.9)
    got, ref = both_paths(logits, batch, params, 5)
    assert_same(got, ref)
    assert bool(calls) == (case == "flat_top_p")


def candidate_rows(vocab: int) -> torch.Tensor:
    """Rows that stress the two-pass selection: random, heavy ties (at the floor and above it),
    -inf everywhere but a few tokens, and large values crowded into one lane."""
    gen = torch.Generator().manual_seed(vocab)
    rows = [3 * torch.randn(vocab, generator=gen) for _ in range(3)]
    rows.append(torch.randint(0, 3, (vocab,), generator=gen).float())  # three values, all tied
    rows.append(torch.zeros(vocab))
    few = torch.full((vocab,), float("-inf"))
    few[: min(vocab, 4)] = torch.arange(min(vocab, 4)).float()
    rows.append(few)
    crowded = torch.randn(vocab, generator=gen)
    crowded[::16] += 10.0  # one lane per 16 holds every large value when Q == 16
    rows.append(crowded)
    return torch.stack(rows)


@pytest.mark.parametrize(("vocab", "ncand"),  # (300, 51) compiled only: interpreted, it runs
                         [(7, 4), (7, 7), (300, 1), (300, 6), (3000, 51)]  # what these run
                         + ([] if INTERPRETED else [(300, 51)]))
def test_candidate_selection_equals_topk(vocab, ncand):
    from rollout_spec.verify_triton import SELECT_MAX, can_select, top_values

    logits = candidate_rows(vocab).to(DEVICE)
    flags = torch.full((logits.shape[0],), 7, dtype=torch.int32, device=DEVICE)
    got = top_values(logits, ncand, flags)
    ref = torch.topk(logits, ncand, dim=-1).values
    ok = flags.cpu().numpy() == 0
    assert set(flags.cpu().tolist()) <= {0, 1}
    assert ok.sum() >= logits.shape[0] - 1  # only a crowded row may overflow the scratch
    np.testing.assert_array_equal(got[:, :ncand].cpu().numpy()[ok], ref.cpu().numpy()[ok])
    assert not can_select(50000, SELECT_MAX + 1)  # beyond the kernel: torch.topk


def test_overflowing_candidates_fall_back_to_the_exact_sort(monkeypatch):
    """Rows whose large values crowd into few lanes overflow the candidate scratch: the rows
    are flagged and the walk re-runs on the reference thresholds, deciding as the reference."""
    calls = []
    exact = fused._exact_thresholds
    monkeypatch.setattr(fused, "_exact_thresholds", lambda *a: calls.append(1) or exact(*a))
    batch = random_batch(np.random.default_rng(9), num_req=2, max_size=1, vocab=6)
    rows, vocab = batch.num_requests + batch.num_nodes, 8192  # Q = 1024: 8 columns per lane
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(9))
    lanes = (torch.arange(vocab) % 1024) < 50
    logits[:, lanes] += 10.0  # 400 values above the 51st lane maximum, CAP = 256
    got, ref = both_paths(logits, batch, SamplingParams(temperature=1.0, top_k=50, top_p=0.9),
                          9)
    assert_same(got, ref)
    assert calls


def test_tree_inputs_of_the_batch_are_reused(monkeypatch):
    batch = random_batch(np.random.default_rng(6), num_req=9, max_size=6, vocab=6)
    logits = friendly_logits(batch, 40, 6)
    zeros = torch.zeros(batch.num_requests, dtype=torch.int64)
    tree = build_tree_inputs(batch, zeros, zeros, DEVICE, width=9)  # wider than needed
    plain = both_paths(logits, batch, SamplingParams(temperature=0.8, top_p=0.9), 1)[0]
    monkeypatch.setattr(fused, "index_arrays", lambda *a: pytest.fail("rebuilt index arrays"))
    reused = both_paths(logits, batch, SamplingParams(temperature=0.8, top_p=0.9), 1, tree)[0]
    assert_same(reused, plain)


@pytest.mark.parametrize("mode", ["greedy", "k5_p0.8", "mixed"])
def test_plain_sampling_uploads_no_index_arrays(mode, monkeypatch):
    """Batches without drafts reuse device index arrays kept per device (grown for a larger
    B, sliced for a smaller one) and still decide as the reference."""
    monkeypatch.setattr(fused, "index_arrays", lambda *a: pytest.fail("uploaded index arrays"))
    monkeypatch.setattr(fused, "_PLAIN_CELLS", {})
    monkeypatch.setattr(fused, "PLAIN_CELLS_MIN", 2)
    for num_req in (2, 5, 3):
        batch = DraftBatch.empty(num_req)
        params = MODES[mode]
        if isinstance(params, list):
            params = [params[b % len(params)] for b in range(num_req)]
        got, ref = both_paths(friendly_logits(batch, 9, num_req), batch, params, num_req)
        assert_same(got, ref)
    assert next(iter(fused._PLAIN_CELLS.values()))[0].shape[0] == 5  # grew 2 -> 5


def test_bfloat16_logits_are_read_in_float32(pre_stats):
    batch = random_batch(np.random.default_rng(7), num_req=6, max_size=4, vocab=6)
    logits = friendly_logits(batch, 50, 7).to(torch.bfloat16)
    for params in (SamplingParams(temperature=0), SamplingParams(temperature=0.9, top_k=4)):
        got, ref = both_paths(logits, batch, params, 7)
        assert_same(got, ref)


@pytest.mark.parametrize("mode", ["greedy", "t0.7", "k5_p0.8"])
def test_row_stats_up_front_change_no_outcome(mode, monkeypatch):
    """With the keyed draws, the walk decides the same whether it makes its row
    passes itself or reads them from ``_row_stats_kernel``: bit-equal outcomes."""
    from rollout_spec import verify_triton

    batch = random_batch(np.random.default_rng(9), num_req=12, max_size=7, vocab=6)
    logits = friendly_logits(batch, WIDE, 9).to(DEVICE)
    reference_thresholds(monkeypatch)
    outcomes = []
    for waves in (0, 1 << 30):
        monkeypatch.setattr(verify_triton, "PRE_STATS_WAVES", waves)
        gen = torch.Generator(device=DEVICE).manual_seed(5)
        outcomes.append(verify(logits, batch, MODES[mode], gen, backend="triton").host)
    assert_same(*outcomes)
    np.testing.assert_array_equal(outcomes[0].emitted_logprobs, outcomes[1].emitted_logprobs)


def test_seeded_runs_reproduce_and_seeds_matter():
    batch = random_batch(np.random.default_rng(8), num_req=8, max_size=6, vocab=5)
    logits = friendly_logits(batch, 20, 8).to(DEVICE)
    sp = SamplingParams(temperature=1.0)
    runs = [verify(logits, batch, sp, torch.Generator(device=DEVICE).manual_seed(s),
                   backend="triton").host for s in (3, 3, 4)]
    np.testing.assert_array_equal(runs[0].emitted_tokens, runs[1].emitted_tokens)
    np.testing.assert_array_equal(runs[0].accepted_nodes, runs[1].accepted_nodes)
    assert not np.array_equal(runs[0].emitted_tokens, runs[2].emitted_tokens)
    gen = torch.Generator(device=DEVICE).manual_seed(3)  # one generator: each call draws anew
    again = [verify(logits, batch, sp, gen, backend="triton").host for _ in range(2)]
    assert not np.array_equal(again[0].emitted_tokens, again[1].emitted_tokens)




def test_tiny_uniforms_decide_as_in_the_reference(pre_stats):
    """The kernel's exponential is the reference's -log1p(-u): a uniform of 1e-30 lets each root
    row's lowest token win (-log u would have made it lose)."""
    batch = random_batch(np.random.default_rng(8), num_req=6, max_size=4, vocab=6)
    logits = friendly_logits(batch, 40, 8)
    noise = torch.full(logits.shape, 0.5)
    far = logits.argmin(dim=-1)
    noise[torch.arange(len(logits)), far] = 1e-30
    table = SamplingTable.from_params(SamplingParams(temperature=1.0), batch.num_requests)
    keys = keys_of(batch.num_requests, 8)
    logits, noise = logits.to(DEVICE), noise.to(DEVICE)
    got, _ = fused.verify_fused(logits, batch, table, keys, None, noise=noise)
    ref = verify_torch(logits, batch, table, keys, noise=noise)
    assert_same(got, ref)
    roots = batch.offsets[:-1] + np.arange(batch.num_requests)  # each request's root row
    assert got.emitted_tokens[got.emitted_offsets[:-1]].tolist() == far[roots].tolist()


@pytest.mark.parametrize("waves", [0, 1 << 30], ids=["walk_passes", "pre_stats"])
@pytest.mark.parametrize("top_k", [-1, 3], ids=["top_p", "top_k_top_p"])
def test_top_p_cut_at_exactly_top_p(top_k, waves, monkeypatch):
    """Probabilities 1/2, 1/4, 1/4 (exact in float32: the row sums to 2 times its maximum's
    term) and top_p = 0.5: the mass before the 1/4 tokens is exactly top_p, and the reference
    keeps a token only while the mass before it is below top_p, so only the 1/2 token. The
    kernel's thresholds cut the same, though the uniforms let a 1/4 token win where kept."""
    from rollout_spec import verify_triton

    monkeypatch.setattr(verify_triton, "PRE_STATS_WAVES", waves)  # thresholds: the kernel's
    batch = DraftBatch.from_lists([[(0, -1)]] * 2)  # rows: root, child (token 0) per request
    logits = torch.full((4, 7), -20.0)
    logits[:, 0] = float(np.float32(math.log(2)))
    logits[:, 1:3] = 0.0
    noise = torch.full(logits.shape, 0.5)
    noise[:, 1:3] = 1e-6
    table = SamplingTable.from_params(SamplingParams(temperature=1.0, top_k=top_k, top_p=0.5),
                                      batch.num_requests)
    keys = keys_of(batch.num_requests, 2)
    logits, noise = logits.to(DEVICE), noise.to(DEVICE)
    got, _ = fused.verify_fused(logits, batch, table, keys, None, noise=noise)
    ref = verify_torch(logits, batch, table, keys, noise=noise)
    assert ref.emitted_tokens.tolist() == [0] * 4  # accepted at the root, the bonus at the child
    assert_same(got, ref)


def test_greedy_ties_take_the_first_column(pre_stats):
    """Greedy rows whose maximum ties in every block of one lane (columns 3, 3 + Q, ...) and in
    a later lane (Q + 8): the kernel takes the first tied column, as torch.argmax does."""
    q = quarter_block(WIDE)
    batch = DraftBatch.from_lists([[(3, -1)]] * 2)  # rows: root, child (token 3) per request
    logits = torch.zeros(4, WIDE)
    logits[:, 3::q] = 1.0
    logits[:, q + 8] = 1.0
    got, ref = both_paths(logits, batch, SamplingParams(temperature=0), 1)
    assert ref.emitted_tokens.tolist() == [3] * 4
    assert_same(got, ref)

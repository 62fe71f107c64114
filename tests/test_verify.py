"""verify(): greedy equals the argmax walk, logprobs equal a reference, results are well formed
and reproducible, bad input is refused. The sampling law itself is tested in test_verify_law.py.
``ROLLOUT_SPEC_TEST_DEVICE=cuda`` runs the walk, logprob and reproducibility tests on a GPU (the
fused Triton path); references stay on the CPU.
"""
import os

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from rollout_spec.config import SamplingParams
from rollout_spec.noise import NoiseKeys, race_uniforms, sample_seed
from rollout_spec.tree import DraftBatch, build_tree_inputs
from rollout_spec.verify import verify
from test_tree import random_batch

DEVICE = torch.device(os.environ.get("ROLLOUT_SPEC_TEST_DEVICE", "cpu"))


def gen_on_device(seed: int) -> torch.Generator:
    """A seeded generator on the test device."""
    return torch.Generator(device=DEVICE).manual_seed(seed)


def reference_logprobs(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """log p over the vocabulary for one row, via transformers' own logits warpers (float64)."""
    scores = row.double()[None]
    if params.greedy:
        return torch.log_softmax(scores, -1)[0]
    scores = TemperatureLogitsWarper(params.temperature)(None, scores)
    if params.top_k > 0:
        scores = TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p < 1:
        scores = TopPLogitsWarper(params.top_p)(None, scores)
    return torch.log_softmax(scores, -1)[0]


def children(batch: DraftBatch, b: int, col: int) -> list[int]:
    """Node indices (within request b's slice) whose parent is column ``col`` (0 = root)."""
    lo, hi = batch.offsets[b], batch.offsets[b + 1]
    return [j for j in range(hi - lo) if batch.parents[lo + j] + 1 == col]


def greedy_walk(logits: torch.Tensor, batch: DraftBatch, b: int):
    """Follow the first child equal to the argmax; return (accepted nodes, emitted tokens, logps)."""
    lo = int(batch.offsets[b])
    col, nodes, toks, lps = 0, [], [], []
    while True:
        row = logits[lo + b + col]
        best = int(row.argmax())
        toks.append(best)
        lps.append(float(torch.log_softmax(row.double(), -1)[best]))
        hit = [j for j in children(batch, b, col) if batch.tokens[lo + j] == best]
        if not hit:
            return nodes, toks, lps
        nodes.append(hit[0])
        col = hit[0] + 1


def split(res, b: int):
    """Request b's accepted nodes, emitted tokens and logprobs as lists."""
    a0, a1 = res.accepted_offsets[b : b + 2].tolist()
    e0, e1 = res.emitted_offsets[b : b + 2].tolist()
    return (res.accepted_nodes[a0:a1].tolist(), res.emitted_tokens[e0:e1].tolist(),
            res.emitted_logprobs[e0:e1].tolist())


def draft_friendly_logits(batch: DraftBatch, vocab: int, seed: int) -> torch.Tensor:
    """Random logits where most nodes' parent rows favour that node's token (long accepts)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch.num_requests + batch.num_nodes, vocab, generator=gen)
    for b in range(batch.num_requests):
        lo = int(batch.offsets[b])
        for j in range(int(batch.sizes()[b])):
            if torch.rand((), generator=gen) < 0.7:
                parent_row = lo + b + int(batch.parents[lo + j]) + 1
                logits[parent_row, batch.tokens[lo + j]] += 4.0
    return logits


@pytest.mark.parametrize("seed", range(4))
def test_greedy_is_the_argmax_walk(seed):
    batch = random_batch(np.random.default_rng(seed), num_req=12, max_size=10, vocab=6)
    logits = draft_friendly_logits(batch, 6, seed)
    res = verify(logits.to(DEVICE), batch, SamplingParams(temperature=0))
    for b in range(batch.num_requests):
        nodes, toks, lps = greedy_walk(logits, batch, b)
        got = split(res, b)
        assert got[0] == nodes and got[1] == toks
        np.testing.assert_allclose(got[2], lps, atol=1e-5)
        assert res.bonus[b] == toks[-1] and res.num_accepted[b] == len(nodes)
    assert int(res.num_accepted.max()) >= 2  # the walk went deeper than one node somewhere


MIXED = [SamplingParams(temperature=0), SamplingParams(temperature=0.7),
         SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=1.3, top_p=0.6),
         SamplingParams(temperature=0.9, top_k=5, top_p=0.8)]


@pytest.mark.parametrize("seed", range(3))
def test_paths_and_logprobs_match_reference(seed):
    """Per-request parameters in one batch: every emitted token walks the tree and reports
    log p(token) of its parent's sampling distribution, computed by transformers' warpers."""
    batch = random_batch(np.random.default_rng(seed), num_req=40, max_size=8, vocab=7)
    logits = draft_friendly_logits(batch, 7, seed)
    params = [MIXED[b % len(MIXED)] for b in range(batch.num_requests)]
    res = verify(logits.to(DEVICE), batch, params, gen_on_device(seed))
    for b in range(batch.num_requests):
        nodes, toks, lps = split(res, b)
        lo, col = int(batch.offsets[b]), 0
        for i, tok in enumerate(toks):
            ref = reference_logprobs(logits[lo + b + col], params[b])
            assert np.isfinite(lps[i]) and lps[i] == pytest.approx(float(ref[tok]), abs=1e-5)
            if i < len(nodes):
                assert batch.parents[lo + nodes[i]] + 1 == col and batch.tokens[lo + nodes[i]] == tok
                col = nodes[i] + 1
            else:  # bonus: never a child of the final node that the sampling law rejected
                kids = {int(batch.tokens[lo + j]) for j in children(batch, b, col)}
                assert tok not in kids or params[b].greedy


def test_empty_batch_is_plain_sampling_with_same_logprobs():
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(1))
    params = [MIXED[b] for b in range(5)]
    res = verify(logits.to(DEVICE), DraftBatch.empty(5), params, gen_on_device(0))
    assert res.num_accepted.tolist() == [0] * 5 and res.emitted_offsets.tolist() == list(range(6))
    for b in range(5):
        ref = reference_logprobs(logits[b], params[b])
        assert float(res.emitted_logprobs[b]) == pytest.approx(float(ref[res.bonus[b]]), abs=1e-5)
    assert int(res.bonus[0]) == int(logits[0].argmax())


def test_a_batch_of_no_requests_and_logits_of_a_graph_are_verified():
    """No request: an empty result on every device (the fused path had nothing to launch and
    indexed a missing first request). Logits that require grad are read as values."""
    res = verify(torch.zeros(0, 8, device=DEVICE), DraftBatch.empty(0), SamplingParams(), gen_on_device(0))
    assert res.emitted_offsets.tolist() == [0] and len(res.emitted_tokens) == 0
    batch = random_batch(np.random.default_rng(1), num_req=6, max_size=5, vocab=9)
    logits = draft_friendly_logits(batch, 9, 1).to(DEVICE)
    plain = verify(logits, batch, SamplingParams(temperature=1.0), gen_on_device(2))
    graph = verify(logits.clone().requires_grad_(), batch, SamplingParams(temperature=1.0), gen_on_device(2))
    assert torch.equal(plain.emitted_tokens, graph.emitted_tokens)
    assert torch.equal(plain.emitted_logprobs, graph.emitted_logprobs)


def test_seeded_runs_reproduce_and_seeds_matter():
    batch = random_batch(np.random.default_rng(0), num_req=64, max_size=8, vocab=5)
    logits = draft_friendly_logits(batch, 5, 0)
    sp = SamplingParams(temperature=1.0)
    runs = [verify(logits.to(DEVICE), batch, sp, gen_on_device(s)) for s in (3, 3, 4)]
    assert torch.equal(runs[0].emitted_tokens, runs[1].emitted_tokens)
    assert torch.equal(runs[0].accepted_nodes, runs[1].accepted_nodes)
    assert not torch.equal(runs[0].emitted_tokens, runs[2].emitted_tokens)


def test_keyed_draws_follow_the_key_not_the_batch():
    """A request's tokens depend on its (seed, position) only: the same request alone, in a
    batch of others, or as a tree node at that position draws the same token; another position
    or seed draws other noise."""
    vocab = 50
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    sp = SamplingParams(temperature=1.0)
    keys = NoiseKeys(torch.tensor([11, 12, 13, 14, 15, 16], device=DEVICE),
                     torch.tensor([5, 9, 9, 0, 3, 7], device=DEVICE))
    batch = verify(logits, DraftBatch.empty(6), sp, keys=keys).host.bonus
    for b in range(6):
        alone = NoiseKeys(keys.seeds[b : b + 1], keys.positions[b : b + 1])
        assert verify(logits[b : b + 1], DraftBatch.empty(1), sp, keys=alone).host.bonus[0] == batch[b]
    # Request 0 drafts the token it samples at position 5; its node row (position 6) then races
    # the noise a plain step at position 6 would.
    tree = DraftBatch.from_lists([[(int(batch[0]), -1)]])
    rows = torch.stack([logits[0], logits[1]])
    got = verify(rows, tree, sp, keys=NoiseKeys(keys.seeds[:1], keys.positions[:1])).host
    plain = verify(logits[1:2], DraftBatch.empty(1), sp,
                   keys=NoiseKeys(keys.seeds[:1], keys.positions[:1] + 1)).host
    assert got.num_accepted[0] == 1 and got.emitted_tokens.tolist() == [batch[0], plain.bonus[0]]
    u = race_uniforms(keys.seeds, keys.positions, vocab)
    assert u.shape == (6, vocab) and float(u.min()) >= 0 and float(u.max()) < 1
    assert torch.equal(u, race_uniforms(keys.seeds, keys.positions, vocab))
    assert not torch.equal(u[0], race_uniforms(keys.seeds[:1], keys.positions[:1] + 1, vocab)[0])


@pytest.mark.skipif(DEVICE.type != "cpu", reason="torch's CPU reductions split rows over threads")
def test_a_rows_logprob_does_not_depend_on_the_batch():
    """At a large vocabulary torch splits a lone row's float32 reduction over threads and a batch
    of rows not: a row's normaliser, so its logprobs and top-p cut, then depended on what else
    was in the call (6 in 20 batches of this test differed with 2 threads before)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        gen = torch.Generator().manual_seed(0)
        sp = SamplingParams(temperature=0.7, top_k=50)
        keys = NoiseKeys(torch.arange(4) + 11, torch.full((4,), 100))
        for _ in range(20):
            logits = torch.randn(4, 151936, generator=gen) * 2
            batch = verify(logits, DraftBatch.empty(4), sp, keys=keys).host.emitted_logprobs
            alone = [verify(logits[b : b + 1], DraftBatch.empty(1), sp,
                            keys=NoiseKeys(keys.seeds[b : b + 1], keys.positions[b : b + 1])).host.emitted_logprobs[0]
                     for b in range(4)]
            assert np.array_equal(batch, np.array(alone))
    finally:
        torch.set_num_threads(threads)


def test_sample_seeds_are_distinct_and_keys_are_checked():
    seeds = {sample_seed(s, p, i) for s in (0, 1) for p in range(50) for i in range(8)}
    assert len(seeds) == 800 and all(0 <= s < 2**63 for s in seeds)
    logits = torch.randn(2, 7).to(DEVICE)
    bad = [NoiseKeys(torch.zeros(3, dtype=torch.int64, device=DEVICE),
                     torch.zeros(2, dtype=torch.int64, device=DEVICE)),
           NoiseKeys(torch.zeros(2, dtype=torch.int64, device=DEVICE),
                     torch.zeros(2, dtype=torch.int32, device=DEVICE))]
    for keys, field in zip(bad, ("keys.seeds", "keys.positions")):
        with pytest.raises(ValueError, match=field):
            verify(logits, DraftBatch.empty(2), SamplingParams(temperature=1.0), keys=keys)


def test_prebuilt_tree_inputs_give_the_same_result():
    batch = random_batch(np.random.default_rng(5), num_req=9, max_size=6, vocab=8)
    logits = draft_friendly_logits(batch, 8, 5)
    zeros = torch.zeros(9, dtype=torch.int64)
    tree = build_tree_inputs(batch, zeros, zeros, width=10)  # wider than needed
    sp = SamplingParams(temperature=0.8, top_p=0.9)
    a = verify(logits, batch, sp, torch.Generator().manual_seed(1), tree=tree)
    b = verify(logits, batch, sp, torch.Generator().manual_seed(1))
    assert torch.equal(a.emitted_tokens, b.emitted_tokens)
    assert torch.equal(a.emitted_logprobs, b.emitted_logprobs)


def test_input_logits_are_not_modified():
    batch = DraftBatch.from_lists([[(1, -1), (2, 0)]])
    logits = torch.randn(3, 4)
    before = logits.clone()
    verify(logits, batch, SamplingParams(temperature=1.0, top_k=2))
    assert torch.equal(logits, before)


BATCH = DraftBatch.from_lists([[(1, -1), (2, 0)], [(3, -1)]])


@pytest.mark.parametrize(
    "logits, sampling, message",
    [
        (torch.zeros(4, 5), SamplingParams(), r"logits must have shape \[B \+ N, V\] = \[5, V\]"),
        (torch.zeros(5), SamplingParams(), "logits must have shape"),
        (torch.zeros(5, 5, dtype=torch.int64), SamplingParams(), "floating point"),
        (torch.zeros(5, 3), SamplingParams(), "DraftBatch.tokens must be < V=3"),
        (torch.zeros(5, 5), [SamplingParams()] * 3, "B=2"),
    ],
)
def test_bad_input_names_the_field(logits, sampling, message):
    with pytest.raises(ValueError, match=message):
        verify(logits, BATCH, sampling)


@pytest.mark.parametrize("poison", ["nan", "inf", "all -inf"])
@pytest.mark.parametrize("sp", [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
                                SamplingParams(temperature=0.7, top_k=3, top_p=0.9)])
def test_non_finite_logits_are_refused_naming_the_request(poison, sp):
    """A NaN or +inf logit, or a row of only -inf, would emit a token with a NaN logprob."""
    logits = torch.randn(5, 5, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    row = 3  # request 1's root (request 0 has two nodes)
    if poison == "all -inf":
        logits[row] = float("-inf")
    else:
        logits[row, 2] = float(poison)
    with pytest.raises(ValueError, match=r"logits of request 1 \(its place in the batch\) are not finite"):
        verify(logits, BATCH, sp)
    logits[row] = 0.0
    assert np.isfinite(verify(logits, BATCH, sp).host.emitted_logprobs).all()


def test_a_finite_logit_that_overflows_at_the_temperature_is_refused_naming_the_cause():
    """1e37 / 0.01 is beyond float32: the row cannot be sampled, and the error says why (it was
    read as a NaN or +inf logit, which the row does not hold)."""
    logits = torch.randn(5, 5, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    logits[3, 2] = 1e37
    with pytest.raises(ValueError, match=r"request 1 .*overflows once divided by the temperature"):
        verify(logits, BATCH, SamplingParams(temperature=0.01))


def test_keyed_uniforms_lie_inside_the_unit_interval_at_their_cells_middle():
    """(x + 1/2) 2^-31 for the word's 31 bits x: never 0 or 1, and fine near 0, where the race's
    exponentials -log1p(-u) are the small ones that let a token far below the best win. (With
    -log u those came from u near 1, 2^-24 apart in float32: tokens 16-20 nats below the best were
    drawn at 4-60% of their probability.)"""
    u = race_uniforms(torch.arange(64), torch.zeros(64, dtype=torch.int64), 50_000).double()
    assert 0 < u.min() and u.max() < 1
    cells = u[u < 2**-16] / 4.6566126e-10  # float32's exact scale: the word's 31 bits, plus 1/2
    assert len(cells) > 10 and torch.allclose(cells - cells.floor(), torch.full_like(cells, 0.5), atol=0.01)


def test_a_tiny_uniform_lets_a_token_far_below_the_best_win():
    """Its exponential is -log1p(-u), about u: 1e-10 against the best token's 0.5 (about 0.69)
    puts a token 20 nats down ahead by log(0.69 / 1e-10) - 20 = 2.6 nats."""
    from rollout_spec.sampling import SamplingTable
    from rollout_spec.verify import verify_torch

    logits = torch.zeros(2, 9, device=DEVICE)
    logits[:, 3] = 20.0
    noise = torch.full((2, 9), 0.5, device=DEVICE)
    noise[:, 7] = 1e-10
    keys = NoiseKeys(torch.arange(2, device=DEVICE), torch.zeros(2, dtype=torch.int64, device=DEVICE))
    table = SamplingTable.from_params(SamplingParams(temperature=1.0), 2)
    host = verify_torch(logits, DraftBatch.empty(2), table, keys, noise=noise)
    assert host.bonus.tolist() == [7, 7]
    assert np.allclose(host.emitted_logprobs, -20.0 - np.log1p(8 * np.exp(-20.0)), atol=1e-5)


def test_bad_types_are_refused():
    with pytest.raises(TypeError, match=r"sampling\[1\]"):
        verify(torch.zeros(5, 5), BATCH, [SamplingParams(), {"temperature": 1.0}])
    with pytest.raises(TypeError, match="batch"):
        verify(torch.zeros(5, 5), [[(1, -1)]], SamplingParams())
    bad = DraftBatch(offsets=np.array([0, 2], np.int32), tokens=np.array([1, 2], np.int32),
                     parents=np.array([-1, 5], np.int32), probs=np.ones(2, np.float32))
    with pytest.raises(ValueError, match="parents"):
        verify(torch.zeros(3, 5), bad, SamplingParams())


@pytest.mark.parametrize("flat", [False, True])
def test_candidate_truncation_equals_full_sort(flat):
    """Ranking only the largest logits gives the full sort's thresholds, ties included; a flat
    row whose top-p mass lies beyond the candidates falls back to the full sort."""
    from rollout_spec.sampling import _truncation_threshold

    gen = torch.Generator().manual_seed(3)
    scores = (torch.randn(6, 3000, generator=gen) * (0.3 if flat else 3)).round(decimals=1)
    top_k = torch.tensor([5, 50, 3000, 3000, 40, 3000])
    top_p = torch.tensor([1.0, 0.9, 0.9, 0.5, 0.3, 1.0])
    full = _truncation_threshold(scores, top_k, top_p, 3000)
    torch.testing.assert_close(_truncation_threshold(scores, top_k, top_p, 64), full)
    kept = (scores >= full[:, None]).sum(-1)
    assert kept[5] == 3000 and kept[0] >= 5 and (flat or kept[3] < 3000)


def test_large_vocab_top_p_logprobs_match_transformers():
    batch = random_batch(np.random.default_rng(8), num_req=6, max_size=5, vocab=50)
    logits = 4 * torch.randn(batch.num_requests + batch.num_nodes, 2000,
                             generator=torch.Generator().manual_seed(8))
    params = [SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0.6, top_k=30),
              SamplingParams(temperature=1.0, top_p=0.95, top_k=500)] * 2
    res = verify(logits.to(DEVICE), batch, params, gen_on_device(1)).host
    for b in range(batch.num_requests):
        lo, col = int(batch.offsets[b]), 0
        e0, e1 = res.emitted_offsets[b : b + 2]
        nodes = res.accepted_nodes[res.accepted_offsets[b] : res.accepted_offsets[b + 1]]
        for i, tok in enumerate(res.emitted_tokens[e0:e1]):
            ref = reference_logprobs(logits[lo + b + col], params[b])
            assert res.emitted_logprobs[e0 + i] == pytest.approx(float(ref[tok]), abs=1e-4)
            if i < len(nodes):
                col = nodes[i] + 1


@pytest.mark.parametrize("temp", [0.9, 0.7, 1.3, 0.6])
def test_scaling_is_the_ieee_quotient_on_every_device(temp):
    """Thresholds (device), node logprobs (host) and the kernel must see one scaled logit: torch
    multiplies a CUDA tensor by the reciprocal of a Python divisor, which can differ in the last
    bit, and once made a drafted boundary token lose its place in the top-k."""
    from rollout_spec.sampling import scale

    x = 5 * torch.randn(4000, generator=torch.Generator().manual_seed(0))
    exact = (x.double() / torch.tensor(temp, dtype=torch.float32).double()).float()
    assert torch.equal(scale(x.to(DEVICE), temp).cpu(), exact)


def test_an_unknown_backend_is_refused_by_name():
    with pytest.raises(ValueError, match="backend must be 'auto', 'torch' or 'triton', got 'cuda'"):
        verify(torch.zeros(5, 5), BATCH, SamplingParams(), backend="cuda")


def test_triton_off_cuda_without_the_interpreter_is_refused_by_name(monkeypatch):
    """Was triton's own error from inside the launch (on a CPU box: "0 active drivers")."""
    import rollout_spec.verify as verify_module

    monkeypatch.setattr(verify_module, "_triton_installed", lambda: True)  # triton may be absent
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # conftest sets it on a CPU box
    with pytest.raises(ValueError, match=r"^backend='triton' needs a CUDA device or TRITON_INTERPRET=1 "
                                         r"\(triton's CPU interpreter, .*\), got device cpu$"):
        verify(torch.zeros(5, 5), BATCH, SamplingParams(), backend="triton")


@pytest.mark.parametrize("argument, value, message", [
    ("generator", 5, "generator must be None or a Generator, got int"),
    ("keys", (0, 0), "keys must be None or a NoiseKeys, got tuple"),
    ("tree", "tree", "tree must be None or a TreeInputs, got str"),
])
def test_optional_arguments_of_another_type_are_refused_by_name(argument, value, message):
    with pytest.raises(TypeError, match=message):
        verify(torch.zeros(2, 5), DraftBatch.empty(2), SamplingParams(), **{argument: value})


def test_a_tree_of_another_batch_is_refused():
    """A TreeInputs built for another batch (fewer requests here) cannot describe these logits."""
    other = DraftBatch.from_lists([[(1, -1)]])
    tree = build_tree_inputs(other, torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"tree must be built from this batch: \[B, W>=3\] = \[2, >=3\], got \(1, 2\)"):
        verify(torch.zeros(5, 5), BATCH, SamplingParams(), tree=tree)


def test_result_tensors_are_its_only_extra_attributes():
    """Only the CSR fields are served as tensors; any other name is an AttributeError (so
    hasattr and copy see a plain object), and the repr shows the host arrays and device."""
    result = verify(torch.zeros(5, 5), BATCH, SamplingParams(temperature=0.0))
    assert result.bonus.tolist() == [0, 0]
    assert not hasattr(result, "bonuses")
    with pytest.raises(AttributeError, match="VerifyResult has no attribute 'bonuses'"):
        result.bonuses
    assert repr(result).startswith("VerifyResult(HostVerifyResult(") and repr(result).endswith("device=cpu)")

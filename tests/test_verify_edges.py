"""verify() at the edges of the law: ties at the top-p cut and at a top-k of 1, a top-k beyond
the vocabulary, the extreme temperatures, -inf logits, and per-request parameters mixing all of
them (greedy included) in one batch.

Two kinds of checks. Coupling: with keyed noise, every token a speculative step emits (accepted
or bonus) and its logprob equal those of a plain one-row step at the same (seed, position), for
random trees (duplicate siblings, drafts outside the support, rejected subtrees) and logits of
several dtypes and layouts. Law: plain draws over many keys follow a float64 statement of
docs/verification.md's law (chi-square, cells of expected count < 5 pooled, tokens outside the
support forbidden), and the logprobs equal that law's. ``ROLLOUT_SPEC_TEST_DEVICE=cuda`` runs
both on a GPU (the fused kernel).
"""
import os

import numpy as np
import pytest
import torch

from rollout_spec.config import SamplingParams
from rollout_spec.noise import NoiseKeys
from rollout_spec.tree import DraftBatch
from rollout_spec.verify import verify
from test_verify_law import chi_square_pvalue

DEVICE = torch.device(os.environ.get("ROLLOUT_SPEC_TEST_DEVICE", "cpu"))
ALPHA = 1e-4


def law(row: list[float], params: SamplingParams) -> np.ndarray:
    """float64 p over the vocabulary: l / T, top-k (ties kept), top-p over what is left (the
    crossing token and its ties kept), renormalised; greedy: the first argmax."""
    scores = np.asarray(row, np.float64)
    if params.greedy:
        p = np.zeros_like(scores)
        p[np.argmax(scores)] = 1.0
        return p
    scores = scores / params.temperature
    if 0 < params.top_k < len(scores):
        scores = np.where(scores >= np.sort(scores)[::-1][params.top_k - 1], scores, -np.inf)
    if params.top_p < 1:
        p = np.exp(scores - scores.max())
        p /= p.sum()
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]
        keep = max(1, int((before < params.top_p).sum()))
        scores = np.where(scores >= scores[order[keep - 1]], scores, -np.inf)
    p = np.exp(scores - scores.max())
    return p / p.sum()


LAW_CASES = {
    "top_p_cut_on_a_tie": ([2.0, 1.0, 1.0, 1.0, 0.0, -1.0], SamplingParams(top_p=0.6)),
    "top_k_1_on_a_tie": ([3.0, 3.0, 1.0, 0.0], SamplingParams(top_k=1)),
    "top_k_beyond_vocab": ([1.0, 0.5, 0.0, -1.0], SamplingParams(top_k=100)),
    "top_k_and_top_p_on_ties": ([1.0, 1.0, 1.0, 0.0], SamplingParams(top_k=2, top_p=0.5)),
    "top_p_reached_exactly": ([np.log(0.5), np.log(0.25), np.log(0.125), np.log(0.125)],
                              SamplingParams(top_p=0.75)),
    "highest_temperature": ([10.0, 0.0, -10.0, 5.0], SamplingParams(temperature=100.0)),
    "lowest_temperature": ([0.02, 0.0, 0.01, -1.0], SamplingParams(temperature=0.01)),
    "minus_inf_top_p": ([-np.inf, 1.0, -np.inf, 0.5, 0.0], SamplingParams(temperature=0.8, top_p=0.9)),
    "minus_inf_top_k": ([-np.inf, 1.0, -np.inf, 0.5, 0.0], SamplingParams(temperature=0.8, top_k=4)),
}


@pytest.mark.parametrize("case", sorted(LAW_CASES))
def test_plain_draws_follow_the_law_at_its_edges(case):
    row, params = LAW_CASES[case]
    n = 8000
    keys = NoiseKeys(torch.arange(n, dtype=torch.int64, device=DEVICE) * 7919 + 3,
                     torch.full((n,), 17, dtype=torch.int64, device=DEVICE))
    logits = torch.tensor([row], dtype=torch.float32).repeat(n, 1).to(DEVICE)
    host = verify(logits, DraftBatch.empty(n), params, keys=keys).host
    p = law(row, params)
    counts = np.bincount(host.bonus, minlength=len(row))
    assert counts[p == 0].sum() == 0, f"{case}: a token outside the support was drawn"
    assert chi_square_pvalue(counts[p > 0], p[p > 0]) > ALPHA / len(LAW_CASES), counts / n
    assert np.allclose(host.emitted_logprobs, np.log(p[host.bonus]), atol=1e-6)


def random_params(rng: np.random.Generator, vocab: int) -> SamplingParams:
    """Greedy, extreme or plain temperatures with top-k of 1, V - 1, V, beyond V or none, and
    top-p from nearly nothing to all."""
    return SamplingParams(temperature=float(rng.choice([0.0, 0.01, 0.7, 1.0, 100.0])),
                          top_k=int(rng.choice([-1, 1, 2, vocab - 1, vocab, vocab + 5])),
                          top_p=float(rng.choice([1.0, 1e-6, 0.5, 0.8, 0.999])))


def random_logits(rng: np.random.Generator, rows: int, vocab: int) -> np.ndarray:
    """Normal logits, small integers (many ties), or normal logits with -inf holes."""
    kind = rng.integers(3)
    if kind == 0:
        return rng.normal(size=(rows, vocab)) * 2
    if kind == 1:
        return rng.integers(-2, 3, size=(rows, vocab)).astype(np.float64)
    logits = rng.normal(size=(rows, vocab))
    logits[rng.random((rows, vocab)) < 0.4] = -np.inf
    logits[:, 0] = 0.0
    return logits


def steered_to_argmax(trees: list[list[tuple[int, int]]], logits: np.ndarray,
                      rng: np.random.Generator) -> list[list[tuple[int, int]]]:
    """``trees`` with about half their nodes' tokens replaced by the argmax of the parent's logits
    row (the root's row for a root child), so that greedy and cold requests accept chains several
    nodes deep; uniform tokens alone are rarely accepted once, never twice in a row."""
    steered, root = [], 0
    for tree in trees:
        rows = [root if parent < 0 else root + 1 + parent for _, parent in tree]
        steered.append([(int(np.argmax(logits[row])) if rng.random() < 0.5 else token, parent)
                        for (token, parent), row in zip(tree, rows)])
        root += 1 + len(tree)
    return steered


@pytest.mark.parametrize("vocab, dtype, strided", [(12, torch.float32, False),
                                                   (12, torch.bfloat16, True),
                                                   (12, torch.float64, False),
                                                   (3000, torch.float32, False)])
def test_speculative_steps_emit_the_tokens_and_logprobs_of_plain_steps(vocab, dtype, strided):
    """Each emitted token (accepted or bonus) at depth d is what a plain step at position + d
    draws from that row with the same seed, with the same logprob: per-request parameters (greedy
    beside sampling) in one batch, trees with duplicate siblings and drafts outside the support."""
    rng = np.random.default_rng(vocab + 7 * strided)
    deepest = 0
    for _ in range(40 if vocab < 1000 else 12):
        num_req = int(rng.integers(1, 5))
        trees = [[(int(rng.integers(0, vocab)), int(rng.integers(-1, j)) if j else -1)
                  for j in range(int(rng.integers(0, 7)))] for _ in range(num_req)]
        params = [random_params(rng, vocab) for _ in range(num_req)]
        host_logits = random_logits(rng, num_req + sum(len(t) for t in trees), vocab)
        batch = DraftBatch.from_lists(steered_to_argmax(trees, host_logits, rng))
        logits = torch.tensor(host_logits).to(dtype)
        if strided:  # every other column of a wider tensor
            logits = torch.stack([logits, logits], -1).reshape(len(logits), -1)[:, ::2]
        logits = logits.to(DEVICE)
        seeds = torch.tensor(rng.integers(0, 2**62, num_req), dtype=torch.int64, device=DEVICE)
        pos = torch.tensor(rng.integers(0, 1000, num_req), dtype=torch.int64, device=DEVICE)
        spec = verify(logits, batch, params, keys=NoiseKeys(seeds, pos)).host
        for b in range(num_req):
            root = int(batch.offsets[b]) + b
            a0, a1 = spec.accepted_offsets[b : b + 2]
            e0 = spec.emitted_offsets[b]
            path = [root] + [root + 1 + int(j) for j in spec.accepted_nodes[a0:a1]]
            deepest = max(deepest, len(path) - 1)
            for depth, row in enumerate(path):
                key = NoiseKeys(seeds[b : b + 1], pos[b : b + 1] + depth)
                plain = verify(logits[row : row + 1], DraftBatch.empty(1), params[b], keys=key).host
                assert plain.bonus[0] == spec.emitted_tokens[e0 + depth], (params[b], depth)
                assert plain.emitted_logprobs[0] == spec.emitted_logprobs[e0 + depth], (params[b], depth)
    assert deepest >= 2, "no request accepted two draft nodes: the coupling below depth 1 went unchecked"

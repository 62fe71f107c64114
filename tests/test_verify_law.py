"""Tree verification is lossless: emitted tokens have the law of plain sampling from the target.

One verify call holds N_SAMPLES copies of one toy tree (V = 8). For every tree node u reached by
some samples (the root included, i.e. the first emitted token), the token emitted right after
u's path must follow p_u, the target distribution of u's row (computed by transformers' warpers).
Each node gets a chi-square test (cells with expected count < 5 pooled) and tokens outside p_u's
support must never appear. False-alarm rate: each test fails with probability <= ALPHA under a
correct sampler (Bonferroni: every node's test runs at ALPHA / nodes tested). Conditionals of
every prefix determine the joint law, so this covers whole emitted sequences.
``ROLLOUT_SPEC_TEST_DEVICE=cuda`` runs the same tests on a GPU, i.e. through the fused Triton
kernel and its own (Philox) random numbers.
"""
import os

import numpy as np
import pytest
import torch

from rollout_spec.config import SamplingParams
from rollout_spec.tree import DraftBatch
from rollout_spec.verify import verify
from test_verify import reference_logprobs

DEVICE = torch.device(os.environ.get("ROLLOUT_SPEC_TEST_DEVICE", "cpu"))
ALPHA = 1e-4
N_SAMPLES = 200_000
VOCAB = 8

# (parents, ranks): node j's token is the ranks[j]-th most likely token of its parent's row, so
# drafts mix likely and unlikely guesses (and, under top-k/top-p, impossible ones).
SHAPES = {
    "empty": ([], []),
    "chain": ([-1, 0, 1, 2, 3], [0, 0, 1, 0, 0]),
    "wide_root": ([-1, -1, -1, -1, -1], [1, 4, 0, 6, 2]),
    "deep_branches": ([-1, -1, 0, 0, 1, 2, 5, 5, 6], [0, 1, 0, 2, 0, 1, 0, 3, 0]),
    "duplicate_siblings": ([-1, -1, -1, 0, 0, 0], [0, 0, 1, 1, 0, 1]),
}
SETTINGS = {
    "t1.0": SamplingParams(temperature=1.0),
    "t0.7": SamplingParams(temperature=0.7),
    "t1.0_k3": SamplingParams(temperature=1.0, top_k=3),
    "t0.7_p0.8": SamplingParams(temperature=0.7, top_p=0.8),
    "t1.0_k5_p0.9": SamplingParams(temperature=1.0, top_k=5, top_p=0.9),
}


def toy_tree(shape: str, seed: int) -> tuple[list[tuple[int, int]], torch.Tensor]:
    """A tree of the given shape and its target logits (one row for the root, one per node)."""
    parents, ranks = SHAPES[shape]
    logits = 1.5 * torch.randn(1 + len(parents), VOCAB, generator=torch.Generator().manual_seed(seed))
    order = logits.argsort(dim=-1, descending=True)
    nodes = [(int(order[p + 1, r]), p) for p, r in zip(parents, ranks)]
    return nodes, logits


def sample_emitted(nodes, logits, sampling, n: int, seed: int) -> np.ndarray:
    """Emitted sequences of n independent verifications of the tree, padded with -1.

    ``sampling`` is one SamplingParams or n of them (per-request parameters in one call).
    """
    one = DraftBatch.from_lists([nodes])
    size = len(nodes)
    batch = DraftBatch(
        offsets=(np.arange(n + 1) * size).astype(np.int32),
        tokens=np.tile(one.tokens, n), parents=np.tile(one.parents, n),
        probs=np.tile(one.probs, n),
    )
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    res = verify(logits.repeat(n, 1).to(DEVICE), batch, sampling, gen).host
    out = np.full((n, size + 1), -1, np.int64)
    out[np.arange(size + 1)[None, :] <= res.num_accepted[:, None]] = res.emitted_tokens
    return out


def node_pvalues(nodes, logits, params, emitted) -> list[float]:
    """Chi-square p-value of the next emitted token after each distinct reached node path."""
    paths, pvalues = {0: ()}, []
    for j, (tok, parent) in enumerate(nodes):
        paths[j + 1] = paths[parent + 1] + (tok,)
    seen = set()
    for col, path in paths.items():
        if path in seen:  # a duplicate sibling: same prefix, never accepted
            continue
        seen.add(path)
        depth = len(path)
        reached = (emitted[:, depth] >= 0) & (emitted[:, :depth] == np.array(path, np.int64)).all(1)
        if reached.sum() < 100:
            continue
        counts = np.bincount(emitted[reached, depth], minlength=VOCAB)
        probs = reference_logprobs(logits[col], params).exp().numpy()
        assert counts[probs == 0].sum() == 0, f"node {col} emitted a token outside the support"
        pvalues.append(chi_square_pvalue(counts[probs > 0], probs[probs > 0]))
    return pvalues


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square goodness of fit; cells expecting < 5 counts are pooled."""
    expected = counts.sum() * probs / probs.sum()
    small = expected < 5
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    if len(counts) < 2:
        return 1.0
    stat = float(((counts - expected) ** 2 / expected).sum())
    dof = torch.tensor((len(counts) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, torch.tensor(stat / 2, dtype=torch.float64)))


CASES = [(s, t) for s in SHAPES for t in ("t1.0", "t0.7")] + [
    (s, t) for s in ("wide_root", "deep_branches", "duplicate_siblings", "chain")
    for t in ("t1.0_k3", "t0.7_p0.8", "t1.0_k5_p0.9")
]


@pytest.mark.parametrize("shape, setting", CASES)
def test_emitted_tokens_follow_the_target_law(shape, setting):
    seed = sorted(SHAPES).index(shape) * 10 + sorted(SETTINGS).index(setting)
    nodes, logits = toy_tree(shape, seed)
    params = SETTINGS[setting]
    emitted = sample_emitted(nodes, logits, params, N_SAMPLES, seed)
    pvalues = node_pvalues(nodes, logits, params, emitted)
    assert len(pvalues) >= (1 if shape == "empty" else 2)  # the root and some deeper node
    assert min(pvalues) > ALPHA / len(pvalues), pvalues


def test_per_request_parameters_each_follow_their_law():
    """Half the copies sample at T=0.7 with top-k 3, half at T=1.3 with top-p 0.7, in one call."""
    nodes, logits = toy_tree("deep_branches", 99)
    a, b = SamplingParams(temperature=0.7, top_k=3), SamplingParams(temperature=1.3, top_p=0.7)
    out = sample_emitted(nodes, logits, [a, b] * (N_SAMPLES // 2), N_SAMPLES, 7)
    pvalues = node_pvalues(nodes, logits, a, out[0::2]) + node_pvalues(nodes, logits, b, out[1::2])
    assert min(pvalues) > ALPHA / len(pvalues), pvalues


def test_the_check_detects_a_wrong_law():
    """Power: samples drawn at T=1.0 are rejected when the law claimed is T=0.7."""
    nodes, logits = toy_tree("deep_branches", 3)
    emitted = sample_emitted(nodes, logits, SETTINGS["t1.0"], N_SAMPLES, 3)
    pvalues = node_pvalues(nodes, logits, SETTINGS["t0.7"], emitted)
    assert min(pvalues) < ALPHA / len(pvalues)


def test_the_lowest_temperature_draws_tied_tokens_evenly_with_their_logprob():
    """Two tied logits of 50 at MIN_TEMPERATURE (5,000 scaled): each drawn half the time, with a
    logprob of log 1/2 (at the 1e-6 allowed before, 62 / 38 and logprobs off by 0.3)."""
    from rollout_spec.config import MIN_TEMPERATURE
    from rollout_spec.noise import NoiseKeys

    n = 50_000
    keys = NoiseKeys(torch.arange(n, dtype=torch.int64, device=DEVICE) * 7919 + 11,
                     torch.full((n,), 5, dtype=torch.int64, device=DEVICE))
    logits = torch.full((n, 2), 50.0, device=DEVICE)
    host = verify(logits, DraftBatch.empty(n), SamplingParams(temperature=MIN_TEMPERATURE), keys=keys).host
    share = float((host.bonus == 0).mean())
    assert abs(share - 0.5) < 5 * 0.5 / np.sqrt(n), share
    assert np.allclose(host.emitted_logprobs, -np.log(2), atol=1e-3)

"""NgramDrafter.set_noise_keys: proposals aimed at the verifier's keyed race (noise.py)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from rollout_spec import _core
from rollout_spec.config import SpecConfig
from rollout_spec.drafter import NgramDrafter, takes_noise_keys
from rollout_spec.noise import NOISE_TAG, quarter_block, race_uniforms

VOCAB = 100


class KeyRecorder(NgramDrafter):
    """An NgramDrafter that records every noise key it is told: (req_id, seed, temperature,
    vocab_size), in call order (the engine's and the replay's tests use it too)."""

    def __init__(self, config: SpecConfig = SpecConfig()) -> None:
        super().__init__(config)
        self.told: list[tuple] = []

    def set_noise_keys(self, req_ids, seeds, temperatures, vocab_size) -> None:
        super().set_noise_keys(req_ids, seeds, temperatures, vocab_size)
        self.told += [(r, s, t, vocab_size) for r, s, t in zip(req_ids, seeds, temperatures)]


def race_noise(seed: int, position: int) -> np.ndarray:
    """The Gumbel draws the verifier races for a request of this seed at this position (verify:
    -log of the exponential -log1p(-u) of each token's uniform): the larger one wins a tie."""
    u = race_uniforms(torch.tensor([seed]), torch.tensor([position]), VOCAB)[0].double().numpy()
    return -np.log(-np.log1p(-u))


def tied_drafter(sequences: list[list[int]], budget: int) -> NgramDrafter:
    """A drafter whose only evidence is ``sequences`` (global scope), request 0 live on [5, 1, 2]."""
    d = NgramDrafter(SpecConfig(num_draft_tokens=budget, adaptive_budget=False))
    d.add_sequences([None] * len(sequences), sequences)
    d.start(0, [5, 1, 2])
    return d


def test_equal_evidence_goes_to_the_sibling_that_wins_the_race():
    """After [1, 2], 30 and 40 are equally likely; the root row (position 2) races them, so with
    the request's key the drafter proposes the one whose noise is larger, whatever the seed;
    without a key the tie goes to the newer occurrence."""
    winners = set()
    for seed in range(40):
        d = tied_drafter([[1, 2, 30], [1, 2, 40]], budget=1)
        assert d.propose([0]).tokens.tolist() == [40]
        d.set_noise_keys([0], [seed], [1.0], VOCAB)
        u = race_noise(seed, 2)
        expected = 30 if u[30] > u[40] else 40
        assert d.propose([0]).tokens.tolist() == [expected], seed
        winners.add(expected)
    assert winners == {30, 40}


def test_a_node_at_depth_d_meets_the_race_at_root_position_plus_d():
    """Below the single first token 30, 50 and 60 tie; they are raced at position 3."""
    for seed in range(20):
        d = tied_drafter([[1, 2, 30, 50], [1, 2, 30, 60]], budget=2)
        d.set_noise_keys([0], [seed], [1.0], VOCAB)
        u = race_noise(seed, 3)
        assert d.propose([0]).tokens.tolist() == [30, 50 if u[50] > u[60] else 60], seed


def test_the_position_follows_the_committed_tokens():
    """After an extend the root row is one position further on."""
    for seed in range(20):
        d = tied_drafter([[1, 2, 7, 30], [1, 2, 7, 40]], budget=1)
        d.set_noise_keys([0], [seed], [1.0], VOCAB)
        d.extend(0, [7])
        u = race_noise(seed, 3)
        assert d.propose([0]).tokens.tolist() == [30 if u[30] > u[40] else 40], seed


def test_a_none_seed_clears_the_key():
    d = tied_drafter([[1, 2, 30], [1, 2, 40]], budget=1)
    seed = next(s for s in range(100) if race_noise(s, 2)[30] > race_noise(s, 2)[40])
    d.set_noise_keys([0], [seed], [1.0], VOCAB)
    assert d.propose([0]).tokens.tolist() == [30]
    d.set_noise_keys([0], [None], [1.0], VOCAB)
    assert d.propose([0]).tokens.tolist() == [40]


def test_strong_evidence_is_not_overturned_by_noise():
    """One continuation seen eight times against one seen once: the noise reorders siblings only
    as far as the evidence leaves room, so the well-supported token stays first for most seeds."""
    firsts = []
    for seed in range(40):
        d = tied_drafter([[1, 2, 30]] * 8 + [[1, 2, 40]], budget=1)
        d.set_noise_keys([0], [seed], [1.0], VOCAB)
        firsts.append(d.propose([0]).tokens.tolist()[0])
    assert firsts.count(30) >= 30


def test_noise_keys_survive_a_checkpoint(tmp_path):
    path = tmp_path / "drafter.bin"
    for seed in range(10):
        d = tied_drafter([[1, 2, 30, 50], [1, 2, 30, 60], [1, 2, 40]], budget=3)
        d.set_noise_keys([0], [seed], [1.0], VOCAB)
        d.save(path)
        loaded = NgramDrafter.load(path)
        a, b = d.propose([0]), loaded.propose([0])
        assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
        np.testing.assert_array_equal(a.probs, b.probs)


def checkpointed_drafter() -> NgramDrafter:
    """The drafter saved in tests/data/drafter_format4.bin by the format-4 build (and, told a
    noise key, in drafter_format5.bin and drafter_format6.bin)."""
    d = NgramDrafter(SpecConfig(num_draft_tokens=6))
    d.add_sequences([3, 3, None], [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [9, 2, 3, 4, 9]])
    d.start_batch([10, 11], [[5, 1, 2], [9, 2]], [3, None])
    d.propose([10, 11])
    d.extend_batch([10, 11], [[3], [3, 4]])
    return d


@pytest.mark.parametrize("name, keys", [
    ("drafter_format4.bin", None),  # format 4 had no noise keys
    # request 10 told seed 5 at T=0.7 before its proposal; format 5 also wrote match states
    ("drafter_format5.bin", ([10], [5], [0.7], 16)),
    ("drafter_format6.bin", ([10], [5], [0.7], 16)),  # no checksum yet
])
def test_an_older_format_checkpoint_still_loads(name, keys):
    """tests/data: checkpointed_drafter saved by the format-4, 5 and 6 builds."""
    loaded = NgramDrafter.load(Path(__file__).parent / "data" / name)
    fresh = checkpointed_drafter()
    if keys is not None:
        fresh.set_noise_keys(*keys)
    a, b = fresh.propose([10, 11]), loaded.propose([10, 11])
    assert a.offsets.tolist() == b.offsets.tolist() and a.tokens.tolist() == b.tokens.tolist()
    np.testing.assert_array_equal(a.probs, b.probs)
    assert a.num_nodes > 0
    loaded.check_integrity()


@pytest.mark.parametrize("ids, seeds, temps, vocab, match", [
    ([1], [3], [1.0], VOCAB, r"unknown request id"),
    ([0, 0], [3, 4], [1.0, 1.0], VOCAB, r"must not repeat"),
    ([0], [3, 4], [1.0], VOCAB, r"seeds must have one entry per request \(1\)"),
    ([0], [3], [1.0, 1.0], VOCAB, r"temperatures must have one entry per request \(1\)"),
    ([0], [-1], [1.0], VOCAB, r"seeds\[0\] must be in \[0, 9223372036854775807\], got -1"),
    ([0], [2**63], [1.0], VOCAB, r"seeds\[0\] must be in"),
    ([0], [3], [0.0], VOCAB, r"temperatures\[0\] must be in \(0.0, 1000000.0\]"),
    ([0], [3], [float("nan")], VOCAB, r"temperatures\[0\]"),
    ([0], [3], [1.0], 0, r"vocab_size must be in \[1, 2147483647\]"),
])
def test_bad_noise_keys_raise_and_change_nothing(ids, seeds, temps, vocab, match):
    d = tied_drafter([[1, 2, 30], [1, 2, 40]], budget=1)
    with pytest.raises(ValueError, match=match):
        d.set_noise_keys(ids, seeds, temps, vocab)
    assert d.propose([0]).tokens.tolist() == [40]


def test_one_vocabulary_per_drafter_while_keyed_requests_live():
    """The noise's layout follows the vocabulary, and it is kept once per drafter: keying one
    request with another vocab_size would move every other keyed request's race, so it is refused
    while they live (and taken once they have finished, or when they are keyed again with it)."""
    d = tied_drafter([[1, 2, 30], [1, 2, 40]], budget=2)
    d.start(1, [5, 1, 2])
    d.set_noise_keys([0], [7], [1.0], VOCAB)
    want = d.propose([0]).tokens.tolist()
    with pytest.raises(ValueError, match="vocab_size gives another noise layout than the one other live requests"):
        d.set_noise_keys([1], [8], [1.0], 4 * VOCAB)
    assert d.propose([0]).tokens.tolist() == want
    d.set_noise_keys([1], [8], [1.0], VOCAB)  # the same vocabulary: fine
    assert quarter_block(VOCAB + 1) == quarter_block(VOCAB)
    d.set_noise_keys([1], [8], [1.0], VOCAB + 1)  # another size of the same layout: nothing moves
    assert d.propose([0]).tokens.tolist() == want
    d.set_noise_keys([0, 1], [7, 8], [1.0, 1.0], 4 * VOCAB)  # every keyed request at once: fine
    d.finish_batch([0, 1])
    d.start(2, [5, 1, 2])
    d.set_noise_keys([2], [7], [1.0], VOCAB)  # none left keyed with the other one


def test_a_greedy_requests_temperature_is_not_read():
    d = tied_drafter([[1, 2, 30], [1, 2, 40]], budget=1)
    d.set_noise_keys([0], [None], [0.0], VOCAB)
    assert d.propose([0]).tokens.tolist() == [40]


def test_the_drafter_says_it_takes_noise_keys():
    assert takes_noise_keys(NgramDrafter()) and not takes_noise_keys(object())


def test_the_core_races_the_verifiers_tag():
    """The builder's own copy of the counter tag (csrc/race_noise.h) is noise.NOISE_TAG."""
    assert _core.RACE_TAG == NOISE_TAG


def test_the_drafter_runs_without_torch():
    """DESIGN.md: the drafter knows nothing of torch. A process where importing torch fails
    starts, keys, proposes, saves and loads (set_noise_keys reads the noise layout only)."""
    script = (
        "import sys; sys.modules['torch'] = None\n"
        "import os, tempfile\n"
        "from rollout_spec.drafter import NgramDrafter\n"
        "d = NgramDrafter(); d.start(1, [1, 2, 3, 1, 2]); d.set_noise_keys([1], [7], [1.0], 32000)\n"
        "assert d.propose([1]).tokens.tolist()[:1] == [3]\n"
        "path = os.path.join(tempfile.mkdtemp(), 'd.bin'); d.save(path); NgramDrafter.load(path)\n"
        "assert 'torch' not in [m.split('.')[0] for m in sys.modules if sys.modules[m] is not None]\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr

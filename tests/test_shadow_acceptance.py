"""Shadow acceptance: a draft tree walked along what plain steps emitted measures what verifying
it would have accepted -- in law (against ``verify``) and inside the engine."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from rollout_spec import SamplingParams
from rollout_spec.replay import accepted_path
from rollout_spec.tree import DraftBatch
from test_engine import ScriptedDrafter, engine, mixed_prompts, plain_run, tiny_pair
from test_verify import reference_logprobs
from test_verify_law import ALPHA, SETTINGS, SHAPES, chi_square_pvalue, sample_emitted, toy_tree


def test_walk_follows_the_first_sibling_holding_each_token() -> None:
    tokens, parents = [5, 7, 5, 9, 3], [-1, -1, -1, 0, 3]  # node 2 repeats node 0's token
    assert accepted_path(tokens, parents, [5, 9, 3, 1]) == [0, 3, 4]
    assert accepted_path(tokens, parents, [7, 9]) == [1]
    assert accepted_path(tokens, parents, [4, 5]) == []
    assert accepted_path(tokens, parents, [5, 9]) == [0, 3]  # the output ended: so does the walk
    assert accepted_path([], [], [5]) == []


def walk_law(nodes: list[tuple[int, int]], logits: torch.Tensor, params: SamplingParams) -> np.ndarray:
    """P(walked depth = d), d = 0..len(nodes), for a path drawn token by token from the rows:
    a node is reached when its parent was and the parent's draw is its token (first sibling)."""
    probs = [reference_logprobs(row, params).exp().numpy() for row in logits]
    reach = {-1: 1.0}
    depth = {-1: 0}
    law = np.zeros(len(nodes) + 1)
    for j, (tok, parent) in enumerate(nodes):
        if any(t == tok and p == parent for t, p in nodes[:j]):
            continue  # a repeated sibling is never walked into
        reach[j] = reach[parent] * probs[parent + 1][tok]
        depth[j] = depth[parent] + 1
    for j, r in reach.items():
        law[depth[j]] += r
    law[:-1] -= law[1:].copy()  # P(depth >= d) -> P(depth = d)
    return law


@pytest.mark.parametrize("shape", [s for s in SHAPES if s != "empty"])
@pytest.mark.parametrize("setting", ["t1.0", "t0.7_p0.8", "t1.0_k3"])
def test_verify_accepts_as_deep_as_a_plain_path_walks(shape: str, setting: str) -> None:
    """The accepted depth of verify's samples fits the law of the walk along plain draws."""
    seed = 100 + sorted(SHAPES).index(shape) * 10 + sorted(SETTINGS).index(setting)
    nodes, logits = toy_tree(shape, seed)
    params = SETTINGS[setting]
    emitted = sample_emitted(nodes, logits, params, 100_000, seed)
    accepted = (emitted >= 0).sum(axis=1) - 1
    law = walk_law(nodes, logits, params)
    counts = np.bincount(accepted, minlength=len(law))
    assert counts[law == 0].sum() == 0
    assert chi_square_pvalue(counts[law > 0], law[law > 0]) > ALPHA


def test_the_law_check_detects_a_different_tree() -> None:
    """Power: verify's depths on one tree do not fit the walk law of the same tree at T=0.7."""
    nodes, logits = toy_tree("deep_branches", 5)
    emitted = sample_emitted(nodes, logits, SETTINGS["t1.0"], 100_000, 5)
    counts = np.bincount((emitted >= 0).sum(axis=1) - 1, minlength=len(nodes) + 1)
    law = walk_law(nodes, logits, SETTINGS["t0.7"])
    assert chi_square_pvalue(counts[law > 0], law[law > 0]) < ALPHA


class PlainBudget:
    """Never drafts; records what shadow proposals measured on the plain steps."""

    def __init__(self) -> None:
        self.seen: list[np.ndarray] = []

    def __call__(self, batch_size: int) -> int:
        return 0

    def observe_plain(self, accepted: np.ndarray) -> None:
        self.seen.append(accepted.copy())


@pytest.fixture(scope="module")
def model():
    return tiny_pair("llama", seed=3)[1]


@pytest.mark.parametrize("overlap", [False, True])
def test_plain_steps_measure_acceptance_without_changing_outputs(model, overlap: bool) -> None:
    """Greedy, 6 requests, 40 tokens: an oracle drafter's first budget // 2 = 4 nodes are the
    true continuation, so a tree's first k nodes keep min(k, 4); a random drafter's almost
    nothing. Rounds take requests with room for 8 more tokens. Outputs stay the plain ones."""
    prompts = mixed_prompts(6, seed=12)
    params = SamplingParams(temperature=0.0, max_new_tokens=40)
    plain, truth = plain_run(model, prompts, params)
    measured = {}
    for mode in ("oracle", "random"):
        budget = PlainBudget()
        eng = engine(model, ScriptedDrafter(mode, truth, seed=2), draft_budget=budget, overlap_drafter=overlap)
        outs = eng.generate(prompts, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
        assert all(o.num_draft_tokens == 0 for o in outs)
        measured[mode] = np.concatenate(budget.seen)
        assert measured[mode].shape == (6 * 3, 9)  # rounds at 8, 16, 24 tokens (32: too little room)
    assert (measured["oracle"][:, :5] == np.minimum(np.arange(5), 4)).all()
    assert (measured["oracle"][:, 5:] >= 4).all()
    assert measured["random"][:, 8].mean() < 0.2


def test_shadow_rounds_are_the_same_with_and_without_the_worker(model) -> None:
    prompts = mixed_prompts(5, seed=13)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=30, seed=4)
    runs = []
    for overlap in (False, True):
        budget = PlainBudget()
        engine(model, ScriptedDrafter("random", seed=6), draft_budget=budget,
               overlap_drafter=overlap).generate(prompts, params)
        runs.append([a.tolist() for a in budget.seen])
    assert runs[0] == runs[1] and runs[0]


def test_a_drafter_breaking_the_contract_in_a_shadow_round_is_named(model) -> None:
    class TooMany(ScriptedDrafter):
        def propose(self, req_ids, budgets):
            return DraftBatch.from_lists([[(1, -1)]] * (len(req_ids) + 1))

    with pytest.raises(ValueError, match="drafter returned 3 trees for 2 requests"):
        engine(model, TooMany("random"), draft_budget=PlainBudget(), overlap_drafter=False).generate(
            [[1, 2, 3]], SamplingParams(n=2, temperature=0.0, max_new_tokens=30))


class DraftingBudget(PlainBudget):
    """Always offers ``k`` nodes; records what shadow rounds measured."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k

    def __call__(self, batch_size: int) -> int:
        return self.k


@pytest.mark.parametrize("overlap", [False, True])
def test_drafting_steps_measure_sizes_beyond_the_one_offered(model, overlap: bool) -> None:
    """A budget that drafts 1 node every step still learns every size up to the shadow budget
    (8): rounds run after drafting steps' commits. The oracle's first 4 nodes are the true
    continuation, so a tree's first k nodes keep min(k, 4); greedy outputs stay the plain ones."""
    prompts = mixed_prompts(6, seed=12)
    params = SamplingParams(temperature=0.0, max_new_tokens=40)
    plain, truth = plain_run(model, prompts, params)
    budget = DraftingBudget(1)
    eng = engine(model, ScriptedDrafter("oracle", truth, seed=2), draft_budget=budget, overlap_drafter=overlap)
    outs = eng.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert all(o.num_draft_tokens > 0 for o in outs)
    measured = np.concatenate(budget.seen)
    assert measured.shape[1] == 9 and len(measured) >= 6
    assert (measured[:, :5] == np.minimum(np.arange(5), 4)).all()
    assert (measured[:, 5:] >= 4).all()


@pytest.mark.parametrize("k", [0, 1])
def test_the_benchs_probe_counts_only_verified_trees_by_depth(model, k: int) -> None:
    """Shadow rounds propose through ``propose_unverified``: the bench's DrafterProbe times them
    but counts by depth only the trees a verify step walked. A budget of 0 verifies none; one
    of 1 node verifies trees of depth 1, one per drafted node (before, shadow trees of depth 8
    were counted, and replaced the verified tree a request was waiting with)."""
    from rollout_spec.metrics import DrafterProbe

    prompts = mixed_prompts(6, seed=12)
    params = SamplingParams(temperature=0.0, max_new_tokens=40)
    plain, truth = plain_run(model, prompts, params)
    budget = DraftingBudget(k)
    eng = engine(model, ScriptedDrafter("oracle", truth, seed=2), draft_budget=budget)
    eng.drafter = probe = DrafterProbe(eng.drafter)
    outs = eng.generate(prompts, params)
    assert budget.seen, "no shadow round ran"
    drafted, accepted = probe.take_depths()
    assert sum(drafted) == sum(o.num_draft_tokens for o in outs)  # depth-1 trees: one node each
    assert sum(accepted) == sum(o.num_accepted_tokens for o in outs)
    assert len(drafted) == k and probe.take_seconds() > 0


def test_a_round_is_harvested_only_once_its_proposal_and_outputs_are_ready() -> None:
    """``harvest`` keeps a round pending while its proposal runs, then while a request has
    neither emitted ``budget`` tokens since nor finished; it then walks the round once."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    from rollout_spec.engine.commit import RunningBatch
    from rollout_spec.engine.sequence import Sequence
    from rollout_spec.engine.shadow_acceptance import ShadowAcceptance

    future: Future = Future()
    queue = SimpleNamespace(call=lambda fn, req_ids, budgets: future)
    drafter = SimpleNamespace(propose=lambda *a: pytest.fail("called outside the queue"))
    params = SamplingParams(temperature=0.0, max_new_tokens=32)
    seqs = [Sequence(r, r, 0, [1, 2], params, None, frozenset(), 0) for r in range(2)]
    for s in seqs:
        s.output = [5]
    shadow = ShadowAcceptance(budget=2, requests=2)
    shadow.propose(queue, drafter, seqs, RunningBatch.of(seqs), max_model_len=64)
    seen: list[np.ndarray] = []
    shadow.harvest(seen.append)  # the proposal is still running
    future.set_result([([7, 8], [-1, 0]), ([9], [-1])])
    shadow.harvest(seen.append)  # no output has grown yet
    seqs[0].output += [7, 8]
    seqs[1].output += [3]
    shadow.harvest(seen.append)  # request 1 emitted 1 of 2 tokens and runs on
    assert seen == [] and shadow.rounds == 1
    seqs[1].finish_reason = "stop"
    shadow.harvest(seen.append)
    shadow.harvest(seen.append)  # harvested once
    assert len(seen) == 1 and seen[0].tolist() == [[0, 1, 2], [0, 0, 0]]

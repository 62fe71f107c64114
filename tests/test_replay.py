"""Trace format round trip, tree walking, lock-step replay accounting, baseline drafters."""
from __future__ import annotations

import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest

from rollout_spec.config import SpecConfig
from rollout_spec.drafter import NgramDrafter
from rollout_spec.replay import (ArcticDrafter, PromptLookupDrafter, Trace, accepted_length, as_trees,
                                 load_trace, replay, replay_step, save_trace)
from rollout_spec.tree import DraftBatch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from edit_trace import EditSpec, make_edit_trace  # noqa: E402
from test_drafter_noise import KeyRecorder  # noqa: E402  (tests/ is on sys.path under pytest)
from synthetic_trace import SyntheticSpec, make_synthetic_trace  # noqa: E402


def small_trace() -> Trace:
    return Trace(prompts={0: [1, 2, 3], 1: [7, 8]},
                 steps=[[(0, [4, 5, 6, 2]), (0, [4, 5, 9, 2]), (1, [4, 5, 6, 2])],
                        [(1, [4, 5, 6, 2]), (0, [4, 5, 6, 2])]])


class NullDrafter:
    """Never drafts: every iteration emits exactly the bonus token."""

    def start_batch(self, *a): pass
    def extend_batch(self, *a): pass
    def finish_batch(self, *a): pass
    def end_step(self): pass
    def propose(self, ids, budgets): return [([], [])] * len(ids)


class OracleDrafter(NullDrafter):
    """Drafts the recorded continuation (needs the trace), to check the accounting."""

    def __init__(self, trace: Trace):
        self.trace, self.pos, self.rows = trace, {}, {}

    def start_batch(self, ids, prompts, groups):
        for i in ids:
            self.pos[i] = 0

    def extend_batch(self, ids, lists):
        for i, t in zip(ids, lists):
            self.pos[i] += len(t)

    def propose(self, ids, budgets):
        out = []
        for i, b in zip(ids, budgets):
            step, j = self.locate(i)
            resp = self.trace.steps[step][j][1][self.pos[i]:self.pos[i] + b]
            out.append((resp, list(range(-1, len(resp) - 1))))
        return out

    def locate(self, rid):
        for s, rows in enumerate(self.trace.steps):
            if rid < len(rows):
                return s, rid
            rid -= len(rows)
        raise KeyError(rid)


def test_trace_round_trip(tmp_path):
    t = small_trace()
    for name in ("t.json", "t.json.gz"):
        save_trace(t, tmp_path / name)
        u = load_trace(tmp_path / name)
        assert u.prompts == t.prompts and u.steps == t.steps and u.num_tokens == 20


def keyed_trace(temperature: float = 1.0, vocab_size: int | None = 16) -> Trace:
    """small_trace with every response's seed (one left unknown) and the sampling it came from."""
    t = small_trace()
    t.seeds = [[11, None, 13], [21, 22]]
    t.meta = {"sampling": {"temperature": temperature}}
    if vocab_size is not None:
        t.meta["vocab_size"] = vocab_size
    return t


def test_recorded_seeds_round_trip(tmp_path):
    t = keyed_trace()
    save_trace(t, tmp_path / "k.json.gz")
    u = load_trace(tmp_path / "k.json.gz")
    assert u.seeds == t.seeds and u.steps == t.steps and u.noise_keys(1) == ([21, 22], 1.0, 16)
    save_trace(small_trace(), tmp_path / "plain.json")
    assert load_trace(tmp_path / "plain.json").seeds is None  # the shared traces have none


def test_seeds_that_do_not_match_the_responses_are_refused(tmp_path):
    """One seed short, or a step's list missing: refused, never saved with seeds dropped."""
    t = small_trace()
    for seeds in ([[11, None], [21, 22]], [[11, None, 13]]):
        with pytest.raises(ValueError, match=r"seeds must hold one list per step .* \(\[3, 2\]\)"):
            Trace(prompts=t.prompts, steps=t.steps, seeds=seeds)
        t.seeds = seeds  # set after construction: save_trace checks again
        with pytest.raises(ValueError, match="seeds must hold one list per step"):
            save_trace(t, tmp_path / "t.json")
        assert not (tmp_path / "t.json").exists()


def test_first_responses_cuts_every_step_and_its_seeds():
    t = keyed_trace()
    cut = t.first_responses(2)
    assert cut.steps == [t.steps[0][:2], t.steps[1]] and cut.seeds == [[11, None], [21, 22]]
    assert (cut.prompts, cut.meta, t.first_responses(5).steps) == (t.prompts, t.meta, t.steps)
    assert small_trace().first_responses(1).seeds is None
    with pytest.raises(ValueError, match=r"count must be in \[1, inf\], got 0"):
        t.first_responses(0)


def test_load_rejects_a_bad_seed(tmp_path):
    (tmp_path / "bad.json").write_text('{"prompts": [{"group_id": 0, "prompt_ids": [1]}], '
                                       '"steps": [[{"group_id": 0, "response_ids": [1], "seed": -4}]]}')
    with pytest.raises(ValueError, match=r"steps\[0\]\[0\].seed must be an integer in \[0, 2\*\*63\)"):
        load_trace(tmp_path / "bad.json")


def test_a_replay_tells_the_drafter_the_recorded_seeds():
    """Requests get ids 0.. over the steps, and each its response's recorded seed, the
    recording's temperature and vocabulary, as the engine would have told it."""
    d = KeyRecorder()
    replay(d, keyed_trace(temperature=0.7), budget=4)
    assert sorted(d.told) == [(0, 11, 0.7, 16), (1, None, 0.7, 16), (2, 13, 0.7, 16),
                              (3, 21, 0.7, 16), (4, 22, 0.7, 16)]


@pytest.mark.parametrize("trace", [keyed_trace(temperature=0.0), keyed_trace(vocab_size=None), small_trace()],
                         ids=["greedy", "no vocabulary", "no seeds"])
def test_a_replay_without_usable_keys_tells_none(trace):
    d = KeyRecorder()
    replay(d, trace, budget=4)
    assert d.told == []


PROMPT = '{"group_id": 0, "prompt_ids": [1, 2]}'


@pytest.mark.parametrize("text, needle", [
    ('[1, 2]', "a trace needs 'prompts' and 'steps'"),
    ('{"prompts": {}, "steps": []}', "prompts must be a list, got dict"),
    ('{"prompts": [7], "steps": []}', "prompts[0] needs group_id and prompt_ids"),
    ('{"prompts": [{"group_id": "a", "prompt_ids": []}], "steps": []}',
     "prompts[0].group_id must be an integer in [0, 2**31), got 'a'"),
    ('{"prompts": [{"group_id": true, "prompt_ids": []}], "steps": []}',
     "prompts[0].group_id must be an integer in [0, 2**31), got True"),
    (f'{{"prompts": [{PROMPT}, {PROMPT}], "steps": []}}',
     "prompts[1].group_id 0 repeats an earlier prompt's"),
    ('{"prompts": [{"group_id": 0, "prompt_ids": "12"}], "steps": []}',
     "prompts[0].prompt_ids must be a list, got str"),
    ('{"prompts": [{"group_id": 0, "prompt_ids": [1, 2.5]}], "steps": []}',
     "prompts[0].prompt_ids[1] must be a token id in [0, 2**31), got 2.5"),
    (f'{{"prompts": [{PROMPT}], "steps": [{{"group_id": 0}}]}}', "steps[0] must be a list, got dict"),
    (f'{{"prompts": [{PROMPT}], "steps": [[{{"group_id": 0}}]]}}',
     "steps[0][0] needs group_id and response_ids"),
    (f'{{"prompts": [{PROMPT}], "steps": [[], [{{"group_id": 0, "response_ids": [4, 2147483648]}}]]}}',
     "steps[1][0].response_ids[1] must be a token id in [0, 2**31), got 2147483648"),
    ('{"prompts": [], "steps": [], "sampling": "greedy"}', "sampling must be an object, got str"),
    ('{"prompts": [], "steps": [], "sampling": {"temperature": "default"}}',
     "sampling.temperature must be a number in [0, 100], got 'default'"),
    ('{"prompts": [], "steps": [], "vocab_size": 0}', "vocab_size must be an integer in [1, 2**31-1], got 0"),
    ('{"prompts": [], "steps": [], "sampling": {"max_new_tokens": "384"}}',
     "sampling.max_new_tokens must be an integer in [1, 2**24], got '384'"),
    ('{"prompts": [], "steps": [], "sampling": {"max_new_tokens": 0}}',
     "sampling.max_new_tokens must be an integer in [1, 2**24], got 0"),
    ('{"prompts": [], "steps": [], "eos_token_id": "2"}',
     "eos_token_id must be null or a token id in [0, 2**31), got '2'"),
    ('{"prompts": [], "steps": [], "eos_token_id": 2.0}',
     "eos_token_id must be null or a token id in [0, 2**31), got 2.0"),
    ('{"prompts": [], "steps": [], "eos_token_id": -1}',
     "eos_token_id must be null or a token id in [0, 2**31), got -1"),
    ('{"prompts": [], "steps": [], "eos_token_id": 16, "vocab_size": 16}',
     "eos_token_id must be below vocab_size (16), got 16"),
    # a repeated key, which JSON resolves silently to its last value, at any depth
    ('{"prompts": [], "steps": [[]], "steps": []}', "not a JSON trace (key 'steps' appears twice)"),
    ('{"prompts": [{"group_id": 0, "prompt_ids": [1], "group_id": 1}], "steps": []}',
     "not a JSON trace (key 'group_id' appears twice)"),
    ('{"prompts": [], "steps": [], "sampling": {"temperature": 0.6, "temperature": 1.0}}',
     "not a JSON trace (key 'temperature' appears twice)"),
])
def test_load_names_the_malformed_field(tmp_path, text, needle):
    (tmp_path / "bad.json").write_text(text)
    with pytest.raises(ValueError) as got:
        load_trace(tmp_path / "bad.json")
    assert str(got.value) == f"{tmp_path / 'bad.json'}: {needle}"


@pytest.mark.parametrize("eos", ["null", "2"])
def test_load_keeps_a_well_formed_eos_and_sampling(tmp_path, eos):
    (tmp_path / "ok.json").write_text(f'{{"prompts": [], "steps": [], "eos_token_id": {eos}, '
                                      '"sampling": {"temperature": 0.6, "max_new_tokens": 384, "top_p": 0.95}}')
    meta = load_trace(tmp_path / "ok.json").meta
    assert meta["eos_token_id"] == (None if eos == "null" else 2) and meta["sampling"]["max_new_tokens"] == 384


def test_load_rejects_unknown_group(tmp_path):
    (tmp_path / "bad.json").write_text('{"prompts": [], "steps": [[{"group_id": 3, "response_ids": [1]}]]}')
    with pytest.raises(ValueError, match="group_id"):
        load_trace(tmp_path / "bad.json")


def test_accepted_length_walks_the_tree():
    tokens, parents = [5, 6, 7, 8, 9], [-1, -1, 1, 2, 0]
    assert accepted_length(tokens, parents, [6, 7, 8, 1]) == 3
    assert accepted_length(tokens, parents, [5, 9, 1]) == 2
    assert accepted_length(tokens, parents, [5, 7]) == 1  # 7 hangs under 6, not under 5
    assert accepted_length(tokens, parents, [1]) == 0
    assert accepted_length(tokens, parents, [6, 7]) == 2  # the trace ends inside the draft
    assert accepted_length([], [], [1, 2]) == 0


def test_as_trees_slices_a_draft_batch():
    b = DraftBatch.from_lists([[(1, -1), (2, 0)], [], [(3, -1)]])
    assert as_trees(b, 3) == [([1, 2], [-1, 0]), ([], []), ([3], [-1])]


def test_replay_without_drafts_has_tpf_one():
    res = replay(NullDrafter(), small_trace(), budget=8)
    assert [r.tpf for r in res] == [1.0, 1.0]
    assert [r.tokens for r in res] == [12, 8] and [r.verify_steps for r in res] == [12, 8]


def test_replay_with_an_oracle_takes_one_verify_per_budget_plus_one_after_the_prefill():
    """A request's first verify is its prefill: no draft, one token (an oracle knows the first
    token as well, but no engine verifies a draft there)."""
    res = replay(OracleDrafter(small_trace()), small_trace(), budget=3)
    # 4-token responses: the prefill's token, then 3 drafted (all accepted, the bonus cut): 2 each
    assert [r.verify_steps for r in res] == [6, 4] and [r.tpf for r in res] == [2.0, 2.0]
    assert res[0].accepted == 9 and res[0].drafted == 9
    res = replay(OracleDrafter(small_trace()), small_trace(), budget=1)
    # the prefill's token, then 1 drafted + 1 bonus, then the last token drafted: 3 each
    assert [r.verify_steps for r in res] == [9, 6] and res[0].accepted == 6


class PoolDrafter(NullDrafter):
    """Does its proposing on another thread, as a drafter with a thread pool does."""

    def __init__(self, cpu_seconds: float):
        self.cpu_seconds, self.calls = cpu_seconds, 0

    def propose(self, ids, budgets):
        self.calls += 1

        def burn() -> None:
            start = time.thread_time()
            while time.thread_time() - start < self.cpu_seconds:
                pass

        worker = threading.Thread(target=burn)
        worker.start()
        worker.join()
        return super().propose(ids, budgets)


def test_replay_cost_counts_the_work_of_a_drafters_other_threads():
    # Timing by the calling thread alone would charge this drafter next to nothing.
    drafter = PoolDrafter(cpu_seconds=0.01)
    res = replay(drafter, small_trace(), budget=8, steps=[1])
    assert drafter.calls > 0 and res[0].propose_seconds >= 0.99 * drafter.calls * drafter.cpu_seconds


def test_max_live_admits_requests_as_others_finish():
    res = replay(NullDrafter(), small_trace(), budget=8, max_live=1)
    assert res[0].tokens == 12 and res[0].verify_steps == 12


def test_prompt_lookup_copies_from_the_context():
    d = PromptLookupDrafter(2, 5)
    d.start_batch([0], [[1, 2, 3, 4, 9, 1, 2]])
    assert d.propose([0], [3]) == [([3, 4, 9], [-1, 0, 1])]
    d.extend_batch([0], [[5]])
    assert d.propose([0], [3]) == [([], [])]


def test_ngram_drafter_beats_prompt_lookup_on_a_synthetic_trace():
    trace = make_synthetic_trace(SyntheticSpec(prompts=6, n=4, steps=2, max_tokens=120, seed=3))
    ours = replay(NgramDrafter(SpecConfig()), trace, budget=8)
    lookup = replay(PromptLookupDrafter(), trace, budget=8)
    assert [r.tokens for r in ours] == [sum(len(resp) for _, resp in step) for step in trace.steps]
    # siblings and the previous step are what prompt lookup cannot see
    assert ours[1].tpf > lookup[1].tpf > 1.0
    assert ours[1].tpf > ours[0].tpf * 0.9
    # the cost split: propose is timed inside the drafter total, and both phases take time
    for r in ours:
        assert 0.0 < r.propose_seconds < r.drafter_seconds


def test_ngram_drafter_keeps_up_with_prompt_lookup_on_a_code_edit_trace():
    # Responses copy their long prompts: only the request scope helps, and its long keys must
    # reach spans far back behind frequent tokens (with the 1-gram key alone, ours fell 15%
    # below prompt lookup on the full-size trace: 3.57 against 4.19).
    trace = make_edit_trace(EditSpec(prompts=6, file_tokens=600, seed=1))
    ours = replay(NgramDrafter(SpecConfig()), trace, budget=8)
    lookup = replay(PromptLookupDrafter(), trace, budget=8)
    assert lookup[0].tpf > 3.0
    assert ours[0].tpf >= lookup[0].tpf


def test_synthetic_trace_is_deterministic_and_well_formed(tmp_path):
    a = make_synthetic_trace(SyntheticSpec(prompts=3, n=2, steps=2, seed=5))
    b = make_synthetic_trace(SyntheticSpec(prompts=3, n=2, steps=2, seed=5))
    assert a.steps == b.steps and a.prompts == b.prompts
    assert len(a.steps) == 2 and all(len(s) == 6 for s in a.steps)
    assert all(min(r) >= 0 and len(r) <= 384 for s in a.steps for _, r in s)
    save_trace(a, tmp_path / "s.json.gz")
    assert load_trace(tmp_path / "s.json.gz").steps == a.steps
    lengths = np.array([len(r) for s in a.steps for _, r in s])
    assert lengths.std() > 0


def test_replay_refuses_what_it_cannot_run():
    """A cap of no live request would never admit one, and a step the trace lacks has no rows:
    both are errors naming the argument, not a spin or an IndexError."""
    trace = Trace(prompts={0: [1, 2]}, steps=[[(0, [3, 4])]])
    with pytest.raises(ValueError, match=r"max_live must be in \[1, inf\], got 0"):
        replay(PromptLookupDrafter(), trace, max_live=0)
    with pytest.raises(ValueError, match=r"step must be in \[0, 0\], got 5"):
        replay(PromptLookupDrafter(), trace, steps=[5])
    with pytest.raises(ValueError, match="no steps"):
        replay_step(PromptLookupDrafter(), Trace(prompts={}, steps=[]), 0, 8, 0)


def test_an_empty_response_takes_no_verify_step():
    """A recorded response with no tokens (another engine's stop at once) is started and
    finished without a proposal: TPF counts the steps that emitted tokens only."""
    trace = Trace(prompts={0: [1, 2]}, steps=[[(0, [3, 4]), (0, [])]])
    for max_live in (None, 1):
        (result,) = replay(PromptLookupDrafter(), trace, max_live=max_live)
        assert (result.tokens, result.verify_steps, result.tpf) == (2, 2, 1.0)


class GreedyOracle(OracleDrafter):
    """Drafts the recorded continuation two nodes past its budget."""

    def propose(self, ids, budgets):
        return super().propose(ids, [b + 2 if b else 0 for b in budgets])


class TreeDropper(NullDrafter):
    """Proposes one tree fewer than asked for (its last request would verify and emit nothing)."""

    def propose(self, ids, budgets):
        return super().propose(ids, budgets)[:-1]


class SelfParent(NullDrafter):
    """A node that is its own parent: not a topological tree."""

    def propose(self, ids, budgets):
        return [([4], [0]) if b else ([], []) for b in budgets]


class ParentShort(NullDrafter):
    """A tree with one parent fewer than its tokens."""

    def propose(self, ids, budgets):
        return [([4], []) if b else ([], []) for b in budgets]


class BatchTreeAdder(NullDrafter):
    """A DraftBatch with one tree more than asked for."""

    def propose(self, ids, budgets):
        return DraftBatch.from_lists([[]] * (len(ids) + 1))


@pytest.mark.parametrize("drafter, message", [
    (GreedyOracle(small_trace()), "drafter's tree for request 0 has 3 nodes, over its budget of 1"),
    (TreeDropper(), "drafter returned 2 trees for 3 requests"),
    (SelfParent(), r"parents\[i\] must be -1 or in \[0, i\) .*: request 0's node 0 has parent 0"),
    (ParentShort(), "drafter's tree for request 0 has 1 tokens and 0 parents: one parent per token"),
    (BatchTreeAdder(), "drafter returned 4 trees for 3 requests"),
])
def test_replay_refuses_a_proposal_it_would_score_unequally(drafter, message):
    """Every drafter gets the same budget: a tree over it would be credited nodes the others were
    not allowed (until session 85 it was: TPF 2.0 at budget 1, where 1.33 is the most), a missing
    tree would charge a verify that emits nothing (the replay then never ended), and a node that
    does not come after its parent would be walked wrongly. A DraftBatch is held to the same
    contract as a list (until session 86 its surplus trees were silently dropped)."""
    with pytest.raises(ValueError, match=message):
        replay(drafter, small_trace(), budget=1)


def test_prompt_lookup_searches_nothing_at_a_prefill(monkeypatch):
    """A prefill asks for no draft: the search would be timed as its cost, which no other
    drafter pays there."""
    d = PromptLookupDrafter(2, 5)
    d.start_batch([0], [[1, 2, 3, 1, 2]])
    monkeypatch.setattr(d, "propose_one", lambda ctx, k: pytest.fail("searched for a budget of 0"))
    assert d.propose([0], [0]) == [([], [])]


class FakeSuffixCache:
    """Stands in for arctic-inference's SuffixDecodingCache: records what speculate is given."""

    def __init__(self, max_tree_depth, max_cached_requests):
        self.contexts = []

    def start_request(self, req_id, prompt): pass
    def add_active_response(self, req_id, tokens): pass
    def stop_request(self, req_id): pass

    def speculate(self, req_id, context, max_spec_tokens, min_token_prob, use_tree_spec):
        self.contexts.append(context)
        return types.SimpleNamespace(token_ids=[9], parents=[-1])


def test_arctic_adapter_hands_speculate_the_context_without_a_copy(monkeypatch):
    """Arctic takes the context as a list; a numpy array built from it on every call (about 2 us
    of the ~17 us a speculate takes) was timed as Arctic's cost, though vLLM hands it a view of
    its own token buffer."""
    module = types.ModuleType("arctic_inference.suffix_decoding")
    module.SuffixDecodingCache = FakeSuffixCache
    monkeypatch.setitem(sys.modules, "arctic_inference", types.ModuleType("arctic_inference"))
    monkeypatch.setitem(sys.modules, "arctic_inference.suffix_decoding", module)
    d = ArcticDrafter(max_depth=3)
    d.start_batch([0], [[1, 2, 3]])
    d.extend_batch([0], [[4, 5]])
    assert d.propose([0], [8]) == [([9], [-1])]
    assert d.propose([0], [0]) == [([], [])]  # a prefill: no call
    assert [type(c) for c in d.cache.contexts] == [list] and d.cache.contexts == [[3, 4, 5]]

"""NgramDrafter: golden trees on hand-built corpora, scopes, checkpoints, validation errors."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rollout_spec.config import SpecConfig
from rollout_spec.drafter import NgramDrafter
from rollout_spec.tree import DraftBatch

from drafter_states import LIVE_IDS, evicted_drafter


def validated(b: DraftBatch) -> None:
    """Check a copy of the core's batch against the contract (its own copy is ``trusted``)."""
    DraftBatch(offsets=b.offsets, tokens=b.tokens, parents=b.parents, probs=b.probs).validate()


def tree(batch, b: int = 0) -> list[tuple[int, int]]:
    """(token, parent) pairs of request b."""
    lo, hi = batch.offsets[b], batch.offsets[b + 1]
    return list(zip(batch.tokens[lo:hi].tolist(), batch.parents[lo:hi].tolist()))


def test_frequency_order_beats_recency():
    d = NgramDrafter()
    d.add_sequences([None, None, None], [[1, 2, 3], [1, 2, 3], [1, 2, 4]])
    d.start(0, [9, 1, 2])
    b = d.propose([0])
    validated(b)
    assert tree(b) == [(3, -1), (4, -1)]
    # weights: 2 of 3 occurrences continue with 3, each discounted by n / (n + 1)
    np.testing.assert_allclose(b.probs, [2 / 3 * 2 / 3, 1 / 3 * 1 / 2], rtol=1e-6)


def test_recency_breaks_ties():
    d = NgramDrafter()
    d.add_sequences([None, None], [[1, 2, 3], [1, 2, 4]])
    d.start(0, [9, 1, 2])
    assert tree(d.propose([0])) == [(4, -1), (3, -1)]


def test_min_token_prob_prunes_rare_continuations_and_discount_orders():
    corpus = [[1, 2, 3, 4]] * 10 + [[1, 2, 5]]
    d = NgramDrafter(SpecConfig(min_token_prob=0.1))
    d.add_sequences([None] * len(corpus), corpus)
    d.start(0, [1, 2])
    b = d.propose([0])
    assert tree(b) == [(3, -1), (4, 0)]  # 5 follows 1 time in 11: below the 0.1 floor
    # probs: count ratios discounted by n / (n + 1) at every step
    np.testing.assert_allclose(b.probs, [10 / 11 * 10 / 11, 10 / 11 * 10 / 11 * 10 / 11], rtol=1e-6)
    full = NgramDrafter(SpecConfig(adaptive_budget=False))
    full.add_sequences([None] * len(corpus), corpus)
    full.start(0, [1, 2])
    b = full.propose([0])
    assert tree(b) == [(3, -1), (4, 0), (5, -1)]
    np.testing.assert_allclose(b.probs[2], 1 / 11 * 1 / 2, rtol=1e-6)


def test_single_occurrence_chain_decays_by_the_discount():
    d = NgramDrafter()
    d.add_sequences([None], [[1, 2, 3, 4, 5, 6]])
    d.start(0, [1, 2])
    b = d.propose([0])
    assert tree(b) == [(3, -1), (4, 0), (5, 1), (6, 2)]
    np.testing.assert_allclose(b.probs, [0.5, 0.25, 0.125, 0.0625])


def test_budget_caps_nodes_per_request_and_per_batch():
    d = NgramDrafter(SpecConfig(adaptive_budget=False, max_batch_draft_tokens=5))
    d.add_sequences([None] * 3, [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 9, 9], [1, 2, 7]])
    d.start_batch([0, 1], [[1, 2], [5, 1, 2]])
    b = d.propose([0, 1], budgets=[2, 8])
    assert b.sizes().tolist() == [2, 3]  # 2 by its budget, 3 left of the batch's 5
    assert b.num_nodes == 5
    assert d.propose([0, 1], budgets=[0, 0]).num_nodes == 0
    assert d.propose([1]).sizes().tolist() == [5]


def test_empty_index_and_no_match_give_empty_drafts():
    d = NgramDrafter()
    d.start(0, [1, 2, 3])
    assert d.propose([0]).num_nodes == 0
    d.add_sequences([None], [[7, 8, 9]])
    assert d.propose([0]).num_nodes == 0
    assert d.propose([]).num_requests == 0


def test_tree_branches_and_chain_mode():
    # Two continuations with equal counts; the newer one (5 6) wins ties.
    seqs = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 5, 6], [1, 2, 5, 6]]
    for tree_mode, budget, expected in (
        (True, 2, [(5, -1), (3, -1)]),
        (False, 2, [(5, -1), (6, 0)]),
        (True, 4, [(5, -1), (3, -1), (6, 0), (4, 1)]),
    ):
        d = NgramDrafter(SpecConfig(tree=tree_mode, adaptive_budget=False))
        d.add_sequences([None] * 4, seqs)
        d.start(0, [1, 2])
        b = d.propose([0], budgets=[budget])
        validated(b)
        assert tree(b) == expected


def test_prompt_lookup_proposes_a_span_repeated_in_the_prompt():
    d = NgramDrafter()
    d.start(0, [5, 6, 7, 8, 1, 2, 5, 6])
    assert tree(d.propose([0]))[:2] == [(7, -1), (8, 0)]
    d.extend(0, [7, 8])  # the output repeats the span too: now "1 2" follows
    assert tree(d.propose([0]))[0] == (1, -1)


def test_prompt_lookup_reaches_a_span_far_back_behind_a_frequent_last_token():
    # The context ends in "50 51 52 7"; that 4-gram occurs once, at the prompt's start, followed
    # by "60 61 62". Token 7 then recurs 40 times, each time followed by another token, so the
    # span lies far beyond its 1-gram chain's newest records: only the 4-gram key reaches it.
    filler = [t for i in range(40) for t in (7, 100 + i)]
    d = NgramDrafter()
    d.start(0, [50, 51, 52, 7, 60, 61, 62] + filler + [50, 51, 52, 7])
    assert tree(d.propose([0]))[:3] == [(60, -1), (61, 0), (62, 1)]


def test_a_response_repeating_its_own_span_far_back_gets_it_proposed():
    # As above, but the span is the response's own: its 4-gram chain reaches it (prompt lookup
    # searches the output too), where the last token's newest 1-gram records do not.
    filler = [t for i in range(40) for t in (7, 100 + i)]
    d = NgramDrafter()
    d.start(0, [1, 2], group_id=3)
    d.extend(0, [50, 51, 52, 7, 60, 61, 62] + filler + [50, 51, 52, 7])
    assert tree(d.propose([0]))[:3] == [(60, -1), (61, 0), (62, 1)]


# Two tokens whose 1-gram keys agree in the 32 hash bits a request's own index keeps (found by a
# birthday search over the core's n-gram hash): their positions share one chain there.
CHECK_TWINS = (16450, 68281)


def test_a_request_index_chain_shared_by_two_keys_offers_only_the_contexts():
    a, b = CHECK_TWINS
    d = NgramDrafter()
    # The chain of b's check lists a's position (newest) before b's. The token before a (5) is
    # not the context's (6), so nothing else tells a's record apart: a search that trusted the
    # check would propose a's continuation, 9, ahead of b's, 7.
    d.start(0, [b, 7, 5, a, 9, 6, b])
    drafted = tree(d.propose([0]))
    assert drafted[0] == (7, -1)
    assert all(token != 9 for token, parent in drafted if parent == -1)
    d.check_integrity()


def test_group_scope_prefers_a_siblings_continuation():
    d = NgramDrafter()
    # A sibling in group 1 (finished) and, more recently, another group's response.
    d.start(0, [100, 101], group_id=1)
    d.extend(0, [1, 2, 3, 40, 41])
    d.finish(0)
    d.start(1, [200, 201], group_id=2)
    d.extend(1, [1, 2, 3, 50, 51])
    d.finish(1)
    d.start(2, [100, 101], group_id=1)
    d.extend(2, [1, 2, 3])
    assert tree(d.propose([2]))[0] == (40, -1)
    d.start(3, [200, 201], group_id=2)
    d.extend(3, [1, 2, 3])
    assert tree(d.propose([3]))[0] == (50, -1)


def test_live_sibling_output_is_used_in_flight():
    d = NgramDrafter()
    d.start_batch([0, 1], [[9, 9], [9, 9]], [7, 7])
    d.extend(0, [4, 5, 6, 7, 8])
    d.extend(1, [4, 5])
    assert tree(d.propose([1]))[:2] == [(6, -1), (7, 0)]


def test_history_steps_drop_old_group_entries():
    d = NgramDrafter(SpecConfig(history_steps=1, global_weight=0.0))
    d.add_sequences([3], [[1, 2, 3, 4]])
    d.start(0, [1, 2], group_id=3)
    assert tree(d.propose([0]))[0] == (3, -1)
    d.finish(0)
    d.end_step()
    d.start(1, [1, 2], group_id=3)
    assert d.propose([1]).num_nodes > 0  # one step old: still in the group scope
    d.finish(1)
    d.end_step()
    d.end_step()
    d.start(2, [8, 8, 8, 1, 2], group_id=3)
    assert d.propose([2]).num_nodes == 0  # aged out of the group, and global is off
    assert d.stats()["step"] == 3


def test_end_step_rebuilds_only_groups_that_lose_sequences():
    # Group 1's one sequence ages out at the second end_step; group 2's, added a step later, stays.
    d = NgramDrafter(SpecConfig(history_steps=1))
    d.add_sequences([1], [[t % 5 for t in range(4000)]])
    memory = d.stats()["memory_bytes"]
    d.end_step()  # nothing is older than one step: no group changes, nor does its memory
    assert d.stats()["memory_bytes"] == memory
    group1 = d.stats()["group_records"]
    d.add_sequences([2], [[7, 8, 9]])
    group2 = d.stats()["group_records"] - group1
    d.end_step()  # group 1's sequence ages out of its scope (it stays global), group 2's stays
    s = d.stats()
    assert s["num_groups"] == 1 and s["group_records"] == group2
    d.check_integrity()


def test_rebuilt_group_tables_are_sized_by_their_keys():
    # A live request of 4000 positions over 5 distinct tokens stays in its group's scope while an
    # ingested sequence leaves it: the rebuild used to size each key length's table for the 4000
    # kept positions (8192 slots of 32 bytes each), not for the few keys they hold.
    d = NgramDrafter(SpecConfig(history_steps=0))
    d.start(0, [1], group_id=1)
    d.extend(0, [t % 5 for t in range(4000)])
    live = d.stats()["group_records"]
    d.add_sequences([1], [[7, 8, 9]])
    before = d.stats()
    d.end_step()
    after = d.stats()
    assert after["group_records"] == live  # the ingested sequence left, the live one stayed
    assert after["memory_bytes"] <= before["memory_bytes"]
    d.check_integrity()


def test_add_sequences_feeds_group_and_global_scopes():
    d = NgramDrafter(SpecConfig(global_weight=0.0))
    d.add_sequences([4, None], [[1, 2, 30], [1, 2, 31]])
    d.start_batch([0, 1], [[1, 2], [1, 2]], [4, 5])
    b = d.propose([0, 1])
    assert tree(b, 0) == [(30, -1)]
    assert tree(b, 1) == []  # group 5 has nothing and global is off
    stats = d.stats()
    # Only group 4 holds records: a position is indexed once its next token exists, so group 5's
    # request enters its group's index with its first response token.
    assert stats["num_groups"] == 1 and stats["global_records"] > 0
    d.extend(1, [7])
    assert d.stats()["num_groups"] == 2


def test_stats_report_scopes_and_memory():
    d = NgramDrafter()
    d.start(0, list(range(10)), group_id=0)
    d.extend(0, [1, 2, 3])
    s = d.stats()
    for key in ("num_requests", "index_tokens", "memory_bytes", "step", "request_records",
                "group_records", "global_records", "num_groups", "num_sequences"):
        assert key in s
    assert s["num_requests"] == 1 and s["index_tokens"] == 13 and s["memory_bytes"] > 0
    d.check_integrity()


def test_save_load_round_trip_gives_identical_proposals(tmp_path):
    rng = np.random.default_rng(1)
    d, live = evicted_drafter(), LIVE_IDS
    assert d.stats()["evictions"] > 0  # the checkpoint includes an evicted, rebuilt index
    path = tmp_path / "drafter.bin"
    d.save(path)
    e = NgramDrafter.load(path)
    e.check_integrity()
    assert e.config == d.config
    same = lambda s: {k: v for k, v in s.items() if k != "memory_bytes"}  # noqa: E731 (capacity slack differs)
    assert same(e.stats()) == same(d.stats())
    for _ in range(5):
        a, b = d.propose(live), e.propose(live)
        for name in ("offsets", "tokens", "parents", "probs"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
        new = [rng.integers(0, 20, 3) for _ in live]
        d.extend_batch(live, new)
        e.extend_batch(live, new)


def test_load_rejects_a_format_5_request_index_out_of_order(tmp_path):
    """Format 5 saved each request's own index as its positions in order (format 6 rebuilds it
    from the tokens); a format-5 file whose log is not that is refused."""
    data = (Path(__file__).parent / "data" / "drafter_format5.bin").read_bytes()
    # Request 10 (slot 3, tokens 5 1 2 3): a uint64 count of 3, then (slot, position) records.
    log = np.array([3, 0, 3, 0, 3, 1, 3, 2], np.int32).tobytes()
    assert data.count(log) == 1
    swapped = np.array([3, 0, 3, 1, 3, 0, 3, 2], np.int32).tobytes()
    path = tmp_path / "drafter.bin"
    path.write_bytes(data.replace(log, swapped))
    with pytest.raises(RuntimeError, match="request index out of order"):
        NgramDrafter.load(path)


def test_load_rejects_a_foreign_file(tmp_path):
    path = tmp_path / "junk.bin"
    path.write_bytes(b"not a checkpoint at all")
    with pytest.raises(RuntimeError, match="not a rollout-spec drafter checkpoint"):
        NgramDrafter.load(path)


def test_external_corpus_is_proposed_from(tmp_path):
    path = tmp_path / "corpus.npy"
    np.save(path, np.array([5, 6, 7, 8, 9], np.int32))
    d = NgramDrafter(SpecConfig(external_corpora=(str(path),)))
    d.start(0, [1, 6, 7])
    assert tree(d.propose([0]))[0] == (8, -1)


def test_numpy_inputs_are_accepted():
    d = NgramDrafter()
    d.add_sequences(np.array([1]), [np.array([1, 2, 3], np.int64)])
    d.start_batch(np.array([4], np.uint32), [np.array([1, 2], np.int16)], [1])
    d.extend_batch(np.array([4]), [np.array([], np.int64)])
    assert tree(d.propose(np.array([4]), budgets=np.array([8])))[0] == (3, -1)


def test_every_proposal_searches_afresh():
    d = NgramDrafter(SpecConfig(adaptive_budget=False))
    d.add_sequences([None] * 4, [[1, 2, 3, 4, 5, 6, 7, 8, 9]] * 4)
    d.start(0, [1, 2])
    assert [t for t, _ in tree(d.propose([0]))] == [3, 4, 5, 6, 7, 8, 9]
    # A newer, more frequent continuation appears, and the request commits 3 (which the first
    # proposal predicted): the next proposal sees the new text at once.
    d.add_sequences([None] * 8, [[1, 2, 3, 4, 50, 51]] * 8)
    d.extend(0, [3])
    tokens = [t for t, _ in tree(d.propose([0]))]
    assert tokens[:2] == [4, 50]


def test_load_rejects_a_checkpoint_of_an_unknown_format(tmp_path):
    """Version 3 files (one log per key length, last positions indexed) and versions newer than
    this build's are refused by name."""
    d = NgramDrafter()
    d.start(0, [1, 2, 3])
    path = tmp_path / "drafter.bin"
    d.save(path)
    data = bytearray(path.read_bytes())
    assert data[:8] == b"RSSPADR7"
    for version in "38":
        data[7] = ord(version)
        path.write_bytes(bytes(data))
        with pytest.raises(RuntimeError, match=rf"another format version \({version}, this build reads 4 to 7\)"):
            NgramDrafter.load(path)
    data[7] = 0x80  # a damaged version byte: named by value (as a character it was not UTF-8)
    path.write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match=r"another format version \(byte 0x80, this build reads 4 to 7\)"):
        NgramDrafter.load(path)

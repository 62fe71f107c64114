"""SGLang adapter: tree layout, SGLang's own corpus test cases restated, the worker's call flow.

Runs on the real NgramDrafter. SGLang's source is checked where the package is installed
(``pip install --no-deps sglang``); importing SGLang's runtime needs its GPU stack and is not
done here (see docs/sglang.md for what is and is not tested against the real package).
"""
from __future__ import annotations

import importlib.util
import json
from array import array
import shutil
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import numpy as np
import pytest

from argument_errors import argument_error

from rollout_spec.config import SpecConfig
from rollout_spec.integrations.sglang.config import ENV_VAR, server_args, spec_from_env, spec_to_env
from rollout_spec.integrations.sglang.corpus import RolloutSpecCorpus
from rollout_spec.integrations.sglang.plugin import register, sglang_source_dir, upstream_problems
from rollout_spec.integrations.sglang.rid import group_from_rid, rid_with_group, rid_with_group_id
from rollout_spec.integrations.sglang.tree_format import leaf_paths, to_ids_mask, trim_padding
from rollout_spec.tree import DraftBatch

D = 8
SEEDS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 44, 55, 66, 77, 88, 99, 100]]
QUERIES = [[1, 2, 3], [3, 44], [3, 6, 999]]


def corpus(**kw) -> RolloutSpecCorpus:
    """A corpus driven directly (no forward hook) unless ``forward_hook=True`` is given."""
    kw.setdefault("forward_hook", False)
    return RolloutSpecCorpus(max_trie_depth=12, draft_token_num=kw.pop("draft_token_num", D), **kw)


def get(c: RolloutSpecCorpus, queries, rids=None, d: int = D):
    rids = rids or [f"query-{i}" for i in range(len(queries))]
    ids, mask = c.batch_get(rids, queries, [len(q) for q in queries])
    assert ids.dtype == np.int64 and mask.dtype == np.int64
    return ids.reshape(-1, d), mask.reshape(-1, d, d)


def paths(ids, mask) -> set[tuple[int, ...]]:
    return trim_padding(leaf_paths(ids.tolist(), mask.tolist()))


# ---------------------------------------------------------------- layout
def test_layout_of_a_branching_tree_and_padding():
    batch = DraftBatch.from_lists([[(4, -1), (44, -1), (5, 0), (55, 1)], []])
    ids, mask = to_ids_mask(batch, [3, 9], 6)
    ids, mask = ids.reshape(2, 6), mask.reshape(2, 6, 6)
    assert ids.tolist() == [[3, 4, 44, 5, 55, 0], [9, 0, 0, 0, 0, 0]]
    assert mask[0].tolist() == [
        [1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0], [1, 0, 1, 0, 1, 0], [1, 0, 0, 0, 0, 1],
    ]
    assert paths(ids[0], mask[0]) == {(3, 4, 5), (3, 44, 55)}
    assert paths(ids[1], mask[1]) == {(9,)}


def test_layout_truncates_to_draft_slots_keeping_parents():
    batch = DraftBatch.from_lists([[(1, -1), (2, 0), (3, 1), (4, 2), (5, 3)]])
    ids, mask = to_ids_mask(batch, [7], 3)
    assert ids.tolist() == [7, 1, 2]
    assert leaf_paths(ids.tolist(), mask.reshape(3, 3).tolist()) == [[7, 1, 2]]
    with pytest.raises(ValueError, match="roots has 0 tokens for a DraftBatch of 1 requests"):
        to_ids_mask(batch, [], 3)
    with pytest.raises(ValueError, match=r"draft_token_num must be in \[1, inf\], got 0"):
        to_ids_mask(batch, [7], 0)


@pytest.mark.parametrize("mask, shape", [([[1, 0], [1, 1]], r"\(2, 2\)"), ([[1, 0, 0]] * 3 + [[1, 0, 0]], r"\(4, 3\)"),
                                         ([1, 1, 1], r"\(3,\)")])
def test_leaf_paths_refuse_a_mask_that_is_not_one_row_and_column_per_token(mask, shape):
    """A mask of another size than the tokens' would pair slots with the wrong tokens."""
    with pytest.raises(ValueError, match=rf"mask must be 3x3 for 3 tokens, got shape {shape}"):
        leaf_paths([7, 1, 2], mask)
    with pytest.raises(ValueError, match="mask must be 3x3"):
        corpus().leaf_paths_from_mask([7, 1, 2], mask)


def test_the_corpus_gives_leaf_paths_as_sglangs_ngram_corpus_does():
    """``leaf_paths_from_mask`` mirrors SGLang's NgramCorpus debugging helper: root-to-leaf token
    paths of one request's flat tree."""
    mask = [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]]
    assert corpus().leaf_paths_from_mask([7, 1, 2, 5], mask) == [[7, 1, 2], [7, 5]]


# ---------------------------------------------------------------- SGLang's corpus cases
def test_golden_queries_match_sglang_leaf_paths():
    c = corpus()
    c.batch_put(SEEDS)
    c.synchronize()
    ids, mask = get(c, QUERIES)
    assert ids.shape == (3, D) and mask.shape == (3, D, D)
    assert [row[0] for row in ids.tolist()] == [3, 44, 999]
    # SGLang's BFS tree for [1,2,3] is {3-4-5-6, 3-44-55-66-77}. How the 7 slots are split
    # between the two equally likely branches is the drafter's budget policy (ours may go deep
    # on one), so: every leaf path follows a seed and all slots are used.
    got = paths(ids[0], mask[0])
    truths = [(3, 4, 5, 6, 7, 8, 9, 10), (3, 44, 55, 66, 77, 88, 99, 100)]
    assert all(any(t[: len(p)] == p for t in truths) for p in got)
    assert (ids[0, 1:] != 0).all()
    assert paths(ids[1], mask[1]) == {(44, 55, 66, 77, 88, 99, 100)}
    assert paths(ids[2], mask[2]) == {(999,)}
    for m in mask:
        assert m[0].tolist() == [1] + [0] * (D - 1) and (np.diag(m) == 1).all()


def test_no_match_and_empty_corpus_give_bare_root():
    c = corpus()
    c.batch_put([[10, 20, 30, 40, 50]])
    assert get(c, [[999, 888, 777]])[0].tolist() == [[777] + [0] * (D - 1)]
    assert get(corpus(), [[1, 2, 3]])[0].tolist() == [[3] + [0] * (D - 1)]


@pytest.mark.parametrize(
    "puts, query, expected",
    [
        ([[[1, 2, 3, 4, 5]], [[1, 2, 3, 44, 55]]], [1, 2, 3], {4, 44}),  # inserts accumulate
        ([[[100, 200, 7, 8, 9, 50, 51]], [[300, 400, 7, 8, 9, 60, 61]]], [7, 8, 9], {50, 60}),
        ([[[5, 10, 20, 30]]], [5], {10}),  # single-token context
        ([[list(range(1, 20))]], list(range(1, 16)), {16}),  # context longer than the tail
    ],
)
def test_continuations_found(puts, query, expected):
    c = corpus()
    for p in puts:
        c.batch_put(p)
    ids, _ = get(c, [query])
    assert ids[0, 0] == query[-1] and expected <= set(ids[0].tolist())


@pytest.mark.parametrize("repeats", [1, 10])
def test_recent_and_frequent_continuation_wins_single_slot(repeats):
    c = corpus(draft_token_num=2)
    c.batch_put([[1, 2, 3, 10, 11]])
    for _ in range(repeats):
        c.batch_put([[1, 2, 3, 20, 21]])
    assert get(c, [[1, 2, 3]], d=2)[0].tolist() == [[3, 20]]


def test_batch_equals_individual_queries():
    c = corpus()
    c.batch_put(SEEDS)
    ids, mask = get(c, QUERIES)
    for i, q in enumerate(QUERIES):
        one_ids, one_mask = get(corpus_with_seeds(), [q])
        assert paths(one_ids[0], one_mask[0]) == paths(ids[i], mask[i])


def corpus_with_seeds() -> RolloutSpecCorpus:
    c = corpus()
    c.batch_put(SEEDS)
    return c


def test_index_survives_reset_unlike_sglangs_trie():
    c = corpus_with_seeds()
    before = get(c, [[3, 44]])[0].tolist()
    c.reset()  # SGLang's flush_cache; its own corpus returns a bare root after this
    after = get(c, [[3, 44]], rids=["again"])[0].tolist()
    assert after == before and after[0][1] == 55
    c.reset()
    c.reset()
    assert c.stats()["steps"] == 2, "a flush without new tokens since the last is not a step"


def test_a_step_whose_end_raised_is_not_ended_again_by_the_next_flush():
    """A sharing drafter ages and then raises its index's error (a stopped puller): verl's second
    flush of the same weight update must not age the drafter a second time."""
    from rollout_spec.drafter import NgramDrafter

    class FailingShare:
        def __init__(self) -> None:
            self.inner = NgramDrafter(SpecConfig())

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def end_step(self) -> None:
            self.inner.end_step()
            raise RuntimeError("shared-index puller thread failed")

    c = corpus(drafter=FailingShare())
    c.batch_put(SEEDS)
    with pytest.raises(RuntimeError, match="puller"):
        c.reset()
    c.reset()
    assert c.drafter.stats()["step"] == 1 and c.stats()["steps"] == 1


# ---------------------------------------------------------------- the worker's call flow
def worker_steps(c: RolloutSpecCorpus, rid: str, prompt: list[int], output: list[int], tail: int, per_step: int):
    """Drive ``c`` like SGLang's NGRAM worker: tails of ``tail`` tokens, ``per_step`` new each step."""
    proposals = []
    for n in range(1, len(output) + 1, per_step):
        seq = prompt + output[:n]
        c.synchronize()
        ids, mask = c.batch_get([rid], [seq[-tail:]], [len(seq)])
        c.batch_put([seq[-tail:]])
        proposals.append(ids.reshape(D).tolist())
    c.erase_match_state([rid])
    return proposals


def test_worker_flow_rebuilds_stream_and_shares_group():
    prompt = [500, 501, 502, 503]
    answer = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
    c = corpus(spec=SpecConfig(num_draft_tokens=D - 1, global_weight=0.0))
    worker_steps(c, rid_with_group("s0", prompt), prompt, answer, tail=6, per_step=3)
    stats = c.stats()
    assert stats["put_skipped"] == stats["gets"] and stats["put_sequences"] == 0
    assert stats["gap_tokens"] == 0 and stats["live_requests"] == 0
    # The sibling (same prompt => same group) is drafted from the first sample's tokens.
    first = worker_steps(c, rid_with_group("s1", prompt), prompt, answer[:2], tail=6, per_step=1)
    assert first[1][:6] == [12, 13, 14, 15, 16, 17]
    # Another prompt's request has no group in common and the global scope is off.
    other = worker_steps(c, rid_with_group("s2", [9, 9]), [9, 9], answer[:2], tail=6, per_step=1)
    assert other[1][1:] == [0] * (D - 1)


def test_gap_and_rollback_are_counted():
    c = corpus()
    c.batch_get(["r"], [[1, 2, 3]], [3])
    c.batch_get(["r"], [[5, 6]], [10])  # 7 new tokens, only 2 visible
    c.batch_get(["r"], [[1, 2]], [2])  # shorter than known: start over
    s = c.stats()
    assert (s["gap_tokens"], s["restarts"], s["requests"]) == (5, 1, 2)


def test_bad_calls_name_the_problem():
    c = corpus()
    with pytest.raises(ValueError, match="equal lengths"):
        c.batch_get(["a"], [[1], [2]], [1])
    with pytest.raises(ValueError, match="must not repeat"):
        c.batch_get(["a", "a"], [[1], [2]], [1, 1])
    with pytest.raises(ValueError, match="empty"):
        c.batch_get(["a"], [[]], [0])
    with pytest.raises(ValueError, match="match_type"):
        corpus(match_type="DFS")
    with pytest.raises(ValueError, match="draft_token_num"):
        corpus(draft_token_num=0)
    with pytest.raises(ValueError, match=r"external_corpus_max_tokens must be in \[0, inf\], got -5"):
        corpus(external_corpus_max_tokens=-5)
    with pytest.raises(TypeError, match=r"max_trie_depth must be an integer in \[1, inf\], got str 'x'"):
        RolloutSpecCorpus(max_trie_depth="x")
    with pytest.raises(TypeError, match="spec must be a SpecConfig, got dict"):
        corpus(spec={"num_draft_tokens": 4})
    with pytest.raises(NotImplementedError, match="cannot remove"):
        c.remove_external_corpus("x")


def test_external_corpus_budget_and_listing():
    c = corpus(external_corpus_max_tokens=12)
    n = c.load_external_corpus_named("docs", [[70, 71, 72, 73, 74], [80, 81]])
    c.commit_external_corpus_load("docs", n)
    assert c.list_external_corpora() == {"docs": 7} and c.remaining_token_budget == 5
    assert get(c, [[70, 71]])[0][0, 1:4].tolist() == [72, 73, 74]
    with pytest.raises(ValueError, match="already"):
        c.load_external_corpus_named("docs", [[1]])
    with pytest.raises(ValueError, match="budget"):
        c.load_external_corpus_named("big", [list(range(6))])


@pytest.mark.parametrize("corpus_id, count, error, message", [
    ("docs", -5, ValueError, r"loaded_token_count must be in \[0, inf\], got -5"),
    ("docs", 3, ValueError, "loaded_token_count of external corpus 'docs' must be 4, .* got 3"),
    ("docs", 4.0, TypeError, "loaded_token_count must be an integer in .*, got float 4.0"),
    ("docs", "4", TypeError, "loaded_token_count must be an integer in .*, got str '4'"),
    ("other", 4, ValueError, "external corpus 'other' has no load to commit"),
])
def test_a_corpus_commit_must_match_its_load(corpus_id, count, error, message):
    """SGLang commits a load with the count ``load_external_corpus_named`` returned; another count
    or corpus would be recorded as loaded (a negative one raising the budget past
    ``external_corpus_max_tokens``), and an uncommitted load still counts against the budget."""
    c = corpus(external_corpus_max_tokens=12)
    assert c.load_external_corpus_named("docs", [[70, 71, 72, 73]]) == 4
    assert c.remaining_token_budget == 8 and c.list_external_corpora() == {}
    with pytest.raises(ValueError, match="'docs' is loaded already"):
        c.load_external_corpus_named("docs", [[1]])
    with pytest.raises(error, match=message):
        c.commit_external_corpus_load(corpus_id, count)
    assert c.remaining_token_budget == 8 and c.list_external_corpora() == {}
    c.commit_external_corpus_load("docs", 4)
    assert c.remaining_token_budget == 8 and c.list_external_corpora() == {"docs": 4}
    with pytest.raises(ValueError, match="'docs' has no load to commit"):
        c.commit_external_corpus_load("docs", 4)


def test_an_empty_external_corpus_is_refused_as_sglang_refuses_it():
    """SGLang's corpus raises on a corpus without tokens (``Ngram::finishExternalCorpusLoad``:
    "External corpus is empty"), so an empty file fails start-up and ``/add_external_corpus``
    answers success=False; ours must not report it loaded with 0 tokens."""
    c = corpus()
    for chunks in ([], [[]], [[-(2**31)]]):
        with pytest.raises(ValueError, match="external corpus 'none' holds no tokens"):
            c.load_external_corpus_named("none", chunks)
    assert c.load_external_corpus_named("none", [[5, 6]]) == 2  # nothing was recorded


def test_a_run_time_corpus_load_goes_in_by_batches_of_whole_documents(monkeypatch):
    """SGLang loads a corpus on a background thread while its scheduler drafts: the documents go
    into the drafter in several calls (its lock free between them), each of whole documents in
    order, and the index ends up as one call would have built it."""
    docs = [[100 + d * 10 + t for t in range(3 + d % 4)] for d in range(12)]
    chunks = [docs[0]] + [[-(2**31)] + doc for doc in docs[1:]]
    calls: list[list[list[int]]] = []

    def loaded(batch_tokens: int) -> RolloutSpecCorpus:
        c = corpus()
        c.load_batch_tokens = batch_tokens
        add = c.drafter.add_sequences
        calls.clear()

        def recorded(groups, sequences, *, pinned):
            calls.append([list(map(int, s)) for s in sequences])
            assert groups == [None] * len(sequences) and pinned is True
            add(groups, sequences, pinned=pinned)

        monkeypatch.setattr(c.drafter, "add_sequences", recorded)
        assert c.load_external_corpus_named("docs", chunks) == sum(map(len, docs)) + len(docs) - 1
        return c

    batched = loaded(10)
    assert len(calls) > 3 and [doc for call in calls for doc in call] == docs
    assert all(sum(map(len, call)) - len(call[-1]) < 10 for call in calls)
    whole = loaded(1 << 20)
    assert len(calls) == 1
    queries = [doc[:2] for doc in docs]
    assert get(batched, queries)[0].tolist() == get(whole, queries)[0].tolist()
    assert get(batched, [docs[5][:2]], rids=["fresh"])[0][0, 1:3].tolist() == docs[5][2:4]


def test_a_bad_token_anywhere_in_a_corpus_loads_none_of_it():
    """Every chunk is checked before any document is indexed: a corpus refused for its last chunk
    leaves the index as it was, and the error names the chunk and the position in it."""
    c = corpus()
    before = c.drafter.stats()["index_tokens"]
    with pytest.raises(ValueError, match=r"external corpus 'docs' chunk 2 holds -7 at position 1: "
                                          r"not a token id in \[0, 2147483647\] nor the separator"):
        c.load_external_corpus_named("docs", [[5, 6, 7], [-(2**31), 8, 9], [10, -7]])
    with pytest.raises(TypeError, match=r"external corpus 'docs' chunk 0 must be a 1-D array of integers"):
        c.load_external_corpus_named("docs", [[1.5, 2.0]])
    assert c.drafter.stats()["index_tokens"] == before
    assert c.load_external_corpus_named("docs", [[5, 6, 7]]) == 3  # nothing was recorded


def _sglang_corpus_chunks(path: Path, docs: list[str], chunk_size: int) -> list[list[int]]:
    """SGLang's own chunking of a JSONL corpus (``cpp_ngram/external_corpus.py``, loaded by path:
    the sglang package itself needs its whole runtime to import), one token per character."""
    if SGLANG_DIR is None:
        pytest.skip("sglang not installed (pip install --no-deps sglang)")
    source = SGLANG_DIR / "srt/speculative/cpp_ngram/external_corpus.py"
    spec = importlib.util.spec_from_file_location("sglang_external_corpus", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    tokenizer = SimpleNamespace(encode=lambda text, add_special_tokens: [1000 + ord(c) for c in text])
    return list(module.iter_external_corpus_chunks(str(path), tokenizer, 10_000, chunk_size=chunk_size))


def test_external_corpus_as_sglang_streams_it(tmp_path):
    """SGLang sends documents as one stream in fixed-size chunks, a separator (-2**31) before each
    document after the first: the chunks of a document are joined, the separator splits them,
    and the corpus stays (pinned) however much traffic the index takes in afterwards."""
    chunks = _sglang_corpus_chunks(tmp_path / "c.jsonl", ["abcdefgh", "xyzw"], chunk_size=3)
    assert min(map(min, chunks)) == -(2**31) and max(map(len, chunks)) == 3
    c = corpus(spec=SpecConfig(num_draft_tokens=4, capacity_tokens=1024))
    assert c.load_external_corpus_named("docs", chunks) == 8 + 1 + 4  # SGLang counts the separator
    tok = {ch: 1000 + ord(ch) for ch in "abcdefghxyzw"}
    queries = iter(range(100))
    chain = lambda q: get(c, [q], rids=[f"q{next(queries)}"])[0][0, 1:4].tolist()  # noqa: E731
    assert chain([tok["b"], tok["c"]]) == [tok["d"], tok["e"], tok["f"]]  # across a chunk's end
    assert chain([tok["x"], tok["y"]]) == [tok["z"], tok["w"], 0]
    assert chain([tok["g"], tok["h"]]) == [0, 0, 0]  # the next document does not continue this one
    rng = np.random.default_rng(0)
    for i in range(40):  # 40 x 64 tokens of traffic through a 1,024-token index
        c.batch_put([tuple(rng.integers(1, 900, 64).tolist())])
        c.reset()
    assert c.drafter.stats()["evictions"] > 0
    assert chain([tok["b"], tok["c"]]) == [tok["d"], tok["e"], tok["f"]]


def test_any_request_id_is_served(tmp_path):
    """A client's id that merely contains the separator, and SGLang's batch renaming of a tagged
    id (``f"{rid}_{i}"``), draft like any other; the first has no group, the second keeps it."""
    c = corpus_with_seeds()
    rids = ["user|rsg=v2", rid_with_group("job", [1, 2]) + "_0"]
    ids, _ = get(c, [[1, 2, 3], [1, 2, 3]], rids=rids)
    assert ids[0, 1] == ids[1, 1] in (4, 44)  # a seed's continuation
    c.erase_match_state(rids)
    c.reset()


# ---------------------------------------------------------------- ids, config, plugin
def test_group_travels_in_request_id():
    rid = rid_with_group("abc", [1, 2, 3])
    assert rid.startswith("abc|rsg=") and rid_with_group(rid, [4]) == rid
    assert group_from_rid(rid) == group_from_rid(rid_with_group("other", [1, 2, 3]))
    assert group_from_rid(rid) != group_from_rid(rid_with_group("abc", [1, 2, 4]))
    assert 0 <= group_from_rid(rid) < 2**31 and group_from_rid("plain-id") is None
    # SGLang's batch renaming of one id (io_struct's _normalize_rid) keeps the group
    assert group_from_rid(f"{rid}_0") == group_from_rid(f"{rid}_12") == group_from_rid(rid)
    # any other text after the separator is a client's id, not ours: no group, and tagged anew
    for other in ("x|rsg=zz", "user|rsg=v2", "a|rsg=8000000a", "a|rsg=0000000a_", "a|rsg=0000000a_x",
                  "a|rsg=0000000A"):
        assert group_from_rid(other) is None
        assert group_from_rid(rid_with_group(other, [1, 2, 3])) == group_from_rid(rid)


@pytest.mark.parametrize("request_id", [7, b"abc", None])
def test_a_request_id_that_is_not_text_is_refused_by_type(request_id):
    """SGLang's rids are str: another type would make a group suffix of its repr."""
    with pytest.raises(TypeError, match=f"request_id must be a str, got {type(request_id).__name__}"):
        rid_with_group(request_id, [1, 2, 3])


@pytest.mark.parametrize("rid", [7, b"a|rsg=00000007", None])
def test_a_rid_that_is_not_text_is_refused_by_type(rid):
    """SGLang's rids are str; another type raised an AttributeError (or bytes' own TypeError)."""
    with pytest.raises(TypeError, match=f"^rid must be a str, got {type(rid).__name__}$"):
        group_from_rid(rid)


def test_a_known_group_id_travels_in_request_id():
    """verl's server tags a later turn with the group of its first prompt, not its own prompt's."""
    rid = rid_with_group_id("abc", 7)
    assert rid == "abc|rsg=00000007" and group_from_rid(rid) == 7 and rid_with_group_id(rid, 9) == rid
    assert rid_with_group_id("x", 2**31 - 1) == "x|rsg=7fffffff"
    assert rid_with_group("x", [1, 2]) == rid_with_group_id("x", group_from_rid(rid_with_group("y", [1, 2])))
    for bad, error in ((-1, ValueError), (2**31, ValueError), ("7", TypeError), (True, TypeError)):
        with pytest.raises(error, match=r"group_id must .*\[0, 2147483647\]"):
            rid_with_group_id("abc", bad)
    with pytest.raises(TypeError, match="request_id must be a str"):
        rid_with_group_id(b"abc", 7)


def test_spec_travels_in_env_and_server_args():
    env: dict[str, str] = {}
    spec = SpecConfig(num_draft_tokens=5, max_match_len=80, tree=False)
    spec_to_env(spec, env)
    assert spec_from_env(env) == spec and spec_from_env({}) is None
    assert server_args(spec) == {
        "speculative_algorithm": "NGRAM",
        "speculative_num_draft_tokens": 6,
        "speculative_ngram_max_trie_depth": 80,
        "speculative_ngram_max_bfs_breadth": 1,
    }
    with pytest.raises(ValueError, match="num_draft_tokens"):
        server_args(SpecConfig(num_draft_tokens=0))
    with pytest.raises(ValueError, match=ENV_VAR):
        spec_from_env({ENV_VAR: "{not json"})
    with pytest.raises(ValueError, match=f"^{ENV_VAR} must hold a JSON object .*recursion"):
        spec_from_env({ENV_VAR: "[" * 100_000})
    with pytest.raises(ValueError, match=f"^{ENV_VAR} must hold .*key 'num_draft_tokens' appears twice"):
        spec_from_env({ENV_VAR: '{"num_draft_tokens": 4, "num_draft_tokens": 6}'})
    with pytest.raises(ValueError, match=f"^{ENV_VAR} has unknown key"):
        spec_from_env({ENV_VAR: json.dumps({"num_draft_token": 3})})
    with pytest.raises(TypeError, match=f"^{ENV_VAR} must be a dict of SpecConfig fields, got list"):
        spec_from_env({ENV_VAR: "[1]"})
    with pytest.raises(ValueError, match=f"^{ENV_VAR}: max_depth must be in"):
        spec_from_env({ENV_VAR: json.dumps({"max_depth": 0})})


def test_corpus_reads_spec_from_env(monkeypatch):
    monkeypatch.setenv(ENV_VAR, json.dumps({"num_draft_tokens": 3}))
    assert RolloutSpecCorpus(draft_token_num=8).spec.num_draft_tokens == 3


def test_plugin_is_inert_without_env(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert register() is False


@pytest.mark.parametrize("value, why", [
    ('{"num_draft_tokens": -3}', r"num_draft_tokens must be in \[0, 1024\]"),
    ("not json", "must hold a JSON object"),
])
def test_plugin_stops_the_scheduler_on_a_bad_variable(monkeypatch, value, why):
    """SystemExit, not an Exception: SGLang's loader catches those and drafts with its own corpus."""
    monkeypatch.setenv(ENV_VAR, value)
    with pytest.raises(SystemExit, match=rf"rollout-spec SGLang plugin \({ENV_VAR} is set\): \w+: .*{why}"):
        register()


def test_plugin_entry_point_imports_without_the_native_core(monkeypatch):
    """SGLang imports every entry point in every scheduler and only logs an ImportError
    (``ep.load()`` in ``sglang/srt/plugins/__init__.py``): importing ours must not load the C++
    core. Then a core that fails to load stops the scheduler from ``register`` when the variable is
    set (instead of SGLang silently drafting with its own corpus), and nothing native loads when
    it is unset."""
    import importlib
    import sys

    saved = dict(sys.modules)
    try:
        for name in [m for m in sys.modules if m == "rollout_spec" or m.startswith("rollout_spec.")]:
            del sys.modules[name]
        sys.modules["rollout_spec._core"] = None  # any import of the core fails, as a broken build's would
        registry = SimpleNamespace(HookRegistry=SimpleNamespace(register=None), HookType=SimpleNamespace(REPLACE=None))
        for name in ("sglang", "sglang.srt", "sglang.srt.plugins"):
            sys.modules[name] = SimpleNamespace(__path__=[])
        sys.modules["sglang.srt.plugins.hook_registry"] = registry
        plugin = importlib.import_module("rollout_spec.integrations.sglang.plugin")
        monkeypatch.delenv(ENV_VAR, raising=False)
        assert plugin.register() is False
        monkeypatch.setenv(ENV_VAR, "{}")
        with pytest.raises(SystemExit, match=rf"^rollout-spec SGLang plugin \({ENV_VAR} is set\): \w*Error: .*_core"):
            plugin.register()
    finally:
        for name in set(sys.modules) - set(saved):
            del sys.modules[name]
        sys.modules.update(saved)


SGLANG_DIR = sglang_source_dir()
needs_sglang_source = pytest.mark.skipif(
    SGLANG_DIR is None, reason="sglang not installed (pip install --no-deps sglang to check its source)"
)


@needs_sglang_source
def test_installed_sglang_has_the_shape_we_patch():
    assert upstream_problems(SGLANG_DIR) == []


@needs_sglang_source
def test_shape_check_fails_when_upstream_changes(tmp_path: Path):
    for rel in ("srt/speculative/ngram_worker.py", "srt/plugins/__init__.py", "srt/managers/scheduler.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(SGLANG_DIR / rel, tmp_path / rel)
    worker = tmp_path / "srt/speculative/ngram_worker.py"
    worker.write_text(worker.read_text().replace("self.ngram_corpus.batch_get(", "self.ngram_corpus.batch_lookup("))
    problems = upstream_problems(tmp_path)
    assert any("batch_lookup" in p for p in problems), problems


def _sglang_plugins_error() -> str | None:
    """Why SGLang's plugin loader cannot run here, or None: the loader and the modules its hooks
    patch must import (they need SGLang's CUDA kernels, e.g. ``sgl_kernel``)."""
    for module in ("sglang.srt.plugins", "sglang.srt.speculative.cpp_ngram.ngram_corpus",
                   "sglang.srt.speculative.ngram_worker"):
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 -- the import error is the skip reason
            return f"{module} not importable here: {type(exc).__name__}: {exc}"[:300]
    return None


PLUGINS_ERROR = "sglang not installed" if SGLANG_DIR is None else _sglang_plugins_error()


@pytest.mark.skipif(PLUGINS_ERROR is not None, reason=PLUGINS_ERROR or "")
def test_sglangs_own_plugin_loader_swaps_in_our_corpus():
    """SGLang's load_plugins (as a scheduler runs it) finds our entry point and replaces the class."""
    import os
    import subprocess
    import sys

    code = (
        "from sglang.srt.plugins import load_plugins; load_plugins();"
        "import sglang.srt.speculative.cpp_ngram.ngram_corpus as m;"
        "print(m.NgramCorpus.__module__ + '.' + m.NgramCorpus.__qualname__)"
    )
    env = {**os.environ, ENV_VAR: json.dumps({"num_draft_tokens": 4})}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.stdout.strip().endswith("rollout_spec.integrations.sglang.corpus.RolloutSpecCorpus"), run.stderr[-2000:]
    env.pop(ENV_VAR)
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.stdout.strip().endswith("ngram_corpus.NgramCorpus"), run.stderr[-2000:]
    env[ENV_VAR] = json.dumps({"num_draft_tokens": -3})  # the loader must not swallow this one
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "num_draft_tokens must be in" in run.stderr and not run.stdout, run.stderr[-2000:]


def test_replay_walks_trees_and_siblings_speed_up_later_steps():
    from rollout_spec.integrations.sglang.replay import accepted_length, replay_step

    batch = DraftBatch.from_lists([[(4, -1), (44, -1), (5, 0), (55, 1)]])
    ids, mask = to_ids_mask(batch, [3], 6)
    assert accepted_length(ids, mask.reshape(6, 6), [44, 55, 9]) == 2
    assert accepted_length(ids, mask.reshape(6, 6), [4, 55]) == 1
    assert accepted_length(ids, mask.reshape(6, 6), [7]) == 0
    answer = list(range(100, 140))
    c = corpus()
    prompts = {0: [1, 2, 3]}
    first = replay_step(c, 0, prompts, [(0, answer)], tail=16)
    assert c.stats()["final_tokens"] == 1  # the last verify's token, indexed as the forward hook would
    again = replay_step(c, 1, prompts, [(0, answer)], tail=16)
    assert first["generated"] == again["generated"] == len(answer) - 1
    assert first["verifies"] == len(answer) - 1  # nothing to draft from yet
    assert again["verifies"] <= -(-(len(answer) - 1) // D) + 1  # the previous step's response is drafted
    # responses that end at their prefill (one token, or none) take no decode step
    short = replay_step(c, 2, prompts, [(0, [5]), (0, []), (0, answer)], tail=16)
    assert (short["verifies"], short["generated"]) == (again["verifies"], again["generated"])
    assert short["accepted"] == again["accepted"] >= 0


def test_replay_erases_departed_requests_when_sglangs_worker_does():
    """``NGRAMWorker.forward_batch_generation`` erases the requests that left the decode batch
    after the next verify's ``batch_put`` (and never an empty list); the last batch's requests
    are erased only by ``flush_cache`` (``reset``). The replay calls the corpus in that order."""
    from rollout_spec.integrations.sglang.replay import replay_step

    calls = []

    class Recording(RolloutSpecCorpus):
        def batch_get(self, req_ids, batch_tokens, total_lens):
            calls.append(("get", [rid.split("|")[0] for rid in req_ids]))
            return super().batch_get(req_ids, batch_tokens, total_lens)

        def batch_put(self, batch_tokens):
            calls.append(("put",))
            super().batch_put(batch_tokens)

        def erase_match_state(self, req_ids):
            req_ids = list(req_ids)
            calls.append(("erase", [rid.split("|")[0] for rid in req_ids]))
            super().erase_match_state(req_ids)

        def reset(self):
            calls.append(("reset",))
            super().reset()

    c = Recording(max_trie_depth=12, draft_token_num=D)
    # nothing to draft from: one token per verify, so the short response leaves after 2 verifies
    replay_step(c, 0, {0: [1, 2, 3]}, [(0, [10, 11, 12]), (0, [20, 21, 22, 23, 24])], tail=16)
    both, last = ("get", ["s0-0", "s0-1"]), ("get", ["s0-1"])
    assert calls == [both, ("put",), both, ("put",), last, ("put",), ("erase", ["s0-0"]),
                     last, ("put",), ("reset",), ("erase", ["s0-1"])]
    assert c.stats()["final_tokens"] == 2  # each response's last verify token


def test_replay_tool_checks_its_options_and_runs_a_trace(tmp_path, capsys):
    from rollout_spec.integrations.sglang.replay import main as replay_main
    from rollout_spec.replay import Trace, save_trace

    path = tmp_path / "t.json.gz"
    answer = list(range(100, 130))
    save_trace(Trace(prompts={0: [1, 2, 3]}, steps=[[(0, answer)], [(0, answer), (0, answer)]]), path)
    for flag, value in (("--tail", "0"), ("--num-draft-tokens", "0"), ("--max-responses", "-1")):
        assert f"{flag}: " in argument_error(replay_main, [str(path), flag, value], capsys)
    err = argument_error(replay_main, [str(path), "--tail", "100000000000000000000"], capsys)  # 10**20: no bound
    assert "--tail: --tail must be in [1, 1048576], got 100000000000000000000" in err
    replay_main([str(path), "--max-responses", "1"])
    rows = capsys.readouterr().out.splitlines()[1:]
    assert [r.split()[:4] for r in rows] == [["0", "1", "0", str(len(answer) - 1)],
                                             ["1", "1", "0", str(len(answer) - 1)]]


def test_replay_tool_refuses_a_trace_without_responses(tmp_path, capsys):
    """A trace with no steps, or a step with no responses, printed the header (or a row of
    zeros) and exited 0; it is an argument error, as in ``rollout-spec replay``."""
    from rollout_spec.integrations.sglang.replay import main as replay_main
    from rollout_spec.replay import Trace, save_trace

    for name, steps in (("none.json", []), ("empty_step.json", [[]])):
        save_trace(Trace(prompts={0: [1, 2, 3]}, steps=steps), tmp_path / name)
        err = argument_error(replay_main, [str(tmp_path / name)], capsys)
        assert f"{name}: every step must hold responses (it has {len(steps)} steps)" in err


def test_replay_tool_bounds_max_responses(tmp_path, capsys):
    """--max-responses took any count, 10**20 included; it is bounded like the other counts."""
    from rollout_spec.integrations.sglang.replay import main as replay_main
    from rollout_spec.replay import Trace, save_trace

    path = tmp_path / "t.json"
    save_trace(Trace(prompts={0: [1, 2, 3]}, steps=[[(0, [4, 5, 6])]]), path)
    err = argument_error(replay_main, [str(path), "--max-responses", str(10**20)], capsys)
    assert f"--max-responses: --max-responses must be in [0, 1048576], got {10**20}" in err
    replay_main([str(path), "--max-responses", "1048576"])
    assert len(capsys.readouterr().out.splitlines()) == 2


def test_replay_tool_checks_the_responses_left_by_max_responses(tmp_path, capsys):
    """The trace was checked before the cut only: a cut that left no token printed rows of zeros,
    and a step left with empty responses only was not named. What is left is checked as a whole
    trace is, the cut named with the trace, and a step without a verify shows "-"."""
    from rollout_spec.integrations.sglang.replay import main as replay_main
    from rollout_spec.replay import Trace, save_trace

    path = tmp_path / "t.json"
    save_trace(Trace(prompts={0: [1, 2, 3]}, steps=[[(0, []), (0, [4, 5, 6])]] * 2), path)
    err = argument_error(replay_main, [str(path), "--max-responses", "1"], capsys)
    assert f"trace {path} (--max-responses 1): every response is empty (no tokens to replay)" in err
    save_trace(Trace(prompts={0: [1, 2, 3]}, steps=[[(0, [4, 5, 6])], [(0, []), (0, [4, 5, 6])]]), path)
    replay_main([str(path), "--max-responses", "1"])
    out, err = capsys.readouterr()
    assert f"NOTE: {path} (--max-responses 1): every response of step 1 is empty" in err
    assert out.splitlines()[2].split() == ["1", "1", "1", "0", "-", "-", "-"]
    replay_main([str(path)])  # no cut: nothing to note
    out, err = capsys.readouterr()
    assert "NOTE" not in err and out.splitlines()[2].split()[:4] == ["1", "2", "1", "2"]


def test_replay_indexes_responses_that_finish_at_their_prefill():
    """Responses of one token end at their prefill: the replay hands them to the corpus as the
    forward hook does (``track_prefill_requests``), so they are indexed, counted as prefill-only
    and take no verify; the next step's response drafts its first tokens from them."""
    from rollout_spec.integrations.sglang.replay import replay_step

    c = corpus(forward_hook=True)
    prompts = {0: [1, 2, 3], 1: [7, 8, 9]}
    first = replay_step(c, 0, prompts, [(0, [40]), (0, [40]), (1, [50, 51, 52])], tail=16)
    assert (c.stats()["prefill_finished"], c.stats()["requests"]) == (2, 3)
    assert (first["prefill_only"], first["verifies"], first["generated"]) == (2, 2, 2)
    # 40 followed 1, 2, 3 only in the prefill-only responses: a later response drafts it there
    later = replay_step(c, 1, prompts, [(1, [60, 1, 2, 3, 40, 61])], tail=16)
    assert later["prefill_only"] == 0 and later["accepted"] >= 1


def test_a_rejected_batch_get_leaves_the_corpus_usable():
    """A call the adapter rejects changes nothing; one whose tokens the drafter rejects drops the
    batch's requests. Either way the same ids draft on the next call and erase/reset still work
    (no request is left known to the adapter but never started in the drafter)."""
    c = corpus_with_seeds()
    get(c, [[1, 2]], rids=["live"])
    with pytest.raises(ValueError, match="request 'b' is empty"):
        c.batch_get(["a", "b"], [[1, 2], []], [2, 0])
    with pytest.raises(ValueError, match="total_lens for request 'live' is 1, below its 2 tokens"):
        c.batch_get(["a", "live"], [[1, 2], [1, 2]], [2, 1])
    assert (c.stats()["requests"], c.stats()["live_requests"]) == (1, 1)
    with pytest.raises(ValueError, match=r"token ids in \[0, 2147483647\]"):
        c.batch_get(["a", "live"], [[1, 2], [1, 2, -5]], [2, 3])
    ids, _ = get(c, [[1, 2, 3], [1, 2, 3]], rids=["a", "live"])
    assert set(ids[:, 1].tolist()) <= {4, 44} and c.stats()["live_requests"] == 2
    c.erase_match_state(["a"])
    c.reset()
    assert c.stats()["live_requests"] == 0


def test_replay_counts_every_draft_of_a_final_verify_as_accepted():
    """When the drafts cover the rest of a response, its last verify has no bonus token: every
    token it commits is an accepted draft (SGLang counts accept_len - 1 = all of them)."""
    from rollout_spec.integrations.sglang.replay import replay_step

    c = corpus()
    prompts = {0: [1, 2, 3]}
    replay_step(c, 0, prompts, [(0, [100, 101, 102, 103, 104])], tail=16)
    r = replay_step(c, 1, prompts, [(0, [100, 101, 102, 103])], tail=16)
    assert (r["verifies"], r["generated"], r["accepted"]) == (1, 3, 3)


def test_replay_charges_the_corpus_cpu_time_of_every_thread_and_not_its_waits():
    """us/req/step is CPU time, as ``rollout_spec.replay`` times a drafter: the replay timed the
    corpus calls by the wall clock, which misses the share of the drafter's propose threads and
    charges the time a call waits (for a CPU, or here in a sleep). Work on another thread during
    a call counts; a call's sleep does not."""
    from rollout_spec.integrations.sglang.replay import replay_step

    def spin(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    class Timed(RolloutSpecCorpus):
        def batch_get(self, req_ids, batch_tokens, total_lens):
            worker = threading.Thread(target=spin, args=(0.03,))
            worker.start()
            worker.join()
            time.sleep(0.2)
            return super().batch_get(req_ids, batch_tokens, total_lens)

    c = Timed(max_trie_depth=12, draft_token_num=D, forward_hook=False)
    totals = replay_step(c, 0, {0: [1, 2, 3]}, [(0, [10, 11, 12])], tail=16)
    assert totals["verifies"] == 2  # nothing to draft from: two calls, 0.06 s of CPU, 0.4 s asleep
    assert 0.06 <= totals["adapter_s"] < 0.3


# ---------------------------------------------------------------- the last verify round
EOS = 2


class FakeReq:
    """The fields of SGLang's ``Req`` (srt/managers/schedule_batch.py) that the NGRAM worker and
    our corpus read. ``output_ids`` is append-only (a spec round may accept tokens past a stop);
    ``Req.update_finish_state`` marks the stop with ``finished_len`` and
    ``Req.output_ids_through_stop`` cuts the output there."""

    def __init__(self, rid: str, prompt: list[int], first_token: Optional[int]):
        self.rid = rid
        self.origin_input_ids_unpadded = array("q", prompt)
        # the token sampled by the prefill; None: not prefilled yet (commit adds it)
        self.output_ids = array("q", [] if first_token is None else [first_token])
        self.finished_len = None

    @property
    def output_ids_through_stop(self):
        return self.output_ids if self.finished_len is None else self.output_ids[: self.finished_len]

    def finished(self) -> bool:
        return self.finished_len is not None

    def commit(self, accepted: list[int]) -> None:
        """Non-overlap result processing (``process_batch_result_decode``): extend, then mark a stop."""
        start = len(self.output_ids)
        self.output_ids.extend(accepted)
        if EOS in accepted:
            self.finished_len = start + accepted.index(EOS) + 1


def decode_batch(reqs: list[FakeReq], decode: bool = True) -> SimpleNamespace:
    return SimpleNamespace(reqs=reqs, forward_mode=SimpleNamespace(is_decode=lambda: decode))


class FakeNgramWorker:
    """SGLang's ``NGRAMWorker`` without overlap scheduling (srt/speculative/ngram_worker.py):
    ``_prepare_draft_tokens`` calls batch_get with each request's tail of
    ``origin_input_ids_unpadded + output_ids`` and their full length; ``_update_ngram_corpus``
    puts the same tails back; ``forward_batch_generation`` then erases the rids of the previous
    decode batch that are not in this one; ``clear_cache_pool`` resets the corpus."""

    def __init__(self, corpus: RolloutSpecCorpus, tail: int):
        self.ngram_corpus = corpus
        self.tail = tail
        self.drafts: dict[str, list[list[int]]] = {}
        self._prev_decode_rids: set[str] = set()

    def forward_batch_generation(self, batch) -> None:
        tails = [list((r.origin_input_ids_unpadded + r.output_ids)[-self.tail:]) for r in batch.reqs]
        lens = [len(r.origin_input_ids_unpadded) + len(r.output_ids) for r in batch.reqs]
        ids, _ = self.ngram_corpus.batch_get([r.rid for r in batch.reqs], tails, lens)
        for r, row in zip(batch.reqs, ids.reshape(len(batch.reqs), -1).tolist()):
            self.drafts.setdefault(r.rid, []).append(row)
        self.ngram_corpus.batch_put(tails)
        current = {r.rid for r in batch.reqs}
        departed = self._prev_decode_rids - current
        if departed:
            self.ngram_corpus.erase_match_state(list(departed))
        self._prev_decode_rids = current

    def clear_cache_pool(self) -> None:
        self.ngram_corpus.reset()
        self._prev_decode_rids = set()


def serve(worker: FakeNgramWorker, rounds: dict[FakeReq, list[list[int]]]) -> None:
    """The scheduler's loop: one decode forward (with our BEFORE hook, as HookRegistry's wrapper
    runs it) per iteration, each request committing its next round; finished requests leave."""
    from rollout_spec.integrations.sglang import plugin

    running = list(rounds)
    while running:
        batch = decode_batch(running)
        plugin.track_batch_requests(worker, batch)
        worker.forward_batch_generation(batch)
        for req in running:
            req.commit(rounds[req].pop(0))
        running = [r for r in running if r.finished_len is None and rounds[r]]


PROMPT = [500, 501, 502, 503]
ROUNDS = [[12, 13, 14], [15, 16, 17], [18, 19, EOS, 77, 78]]  # 77, 78: accepted past the stop


def group_corpus() -> RolloutSpecCorpus:
    return corpus(spec=SpecConfig(num_draft_tokens=D - 1, global_weight=0.0), forward_hook=True)


def test_last_verify_round_reaches_siblings_when_a_request_leaves():
    """The first sample's last round (18, 19, EOS) only ever shows in its final output: the next
    forward erases it and the corpus reads it from the Req, cut at the stop."""
    worker = FakeNgramWorker(group_corpus(), tail=16)
    first = FakeReq(rid_with_group("s0", PROMPT), PROMPT, 11)
    serve(worker, {first: [list(r) for r in ROUNDS]})
    sibling = FakeReq(rid_with_group("s1", PROMPT), PROMPT, 11)
    serve(worker, {sibling: [list(r) for r in ROUNDS]})
    after_17 = worker.drafts[sibling.rid][2]
    assert after_17[:4] == [17, 18, 19, EOS] and 77 not in after_17
    stats = worker.ngram_corpus.stats()
    assert stats["final_tokens"] == 3 and stats["gap_tokens"] == 0


def test_untagged_requests_group_by_their_prompt_and_later_turns_join_it():
    """Without a tag (SGLang outside verl, or n > 1 in one request, whose samples get fresh uuid4
    ids) a request's group comes from its Req's prompt: a sibling drafts from the first sample's
    rounds, a next turn (prompt + output + tool output) from its first turn's group, and another
    prompt from neither (the group scope only: the global scope is off)."""
    worker = FakeNgramWorker(group_corpus(), tail=16)
    serve(worker, {FakeReq("uuid-a", PROMPT, 11): [list(r) for r in ROUNDS]})
    sibling = FakeReq("uuid-b", PROMPT, 11)
    other = FakeReq("uuid-c", [600, 601, 602], 11)
    serve(worker, {sibling: [list(r) for r in ROUNDS], other: [list(r) for r in ROUNDS]})
    assert worker.drafts[sibling.rid][1][:4] == [14, 15, 16, 17]
    assert worker.drafts[other.rid][1][:4] == [14, 0, 0, 0]  # its own tokens only
    next_turn = FakeReq("uuid-d", PROMPT + [11, 12, 13] + [700, 701], 14)  # its own tokens: no 15
    serve(worker, {next_turn: [[15, 16, 17], [18]]})
    assert worker.drafts[next_turn.rid][0][:4] == [14, 15, 16, 17]


def test_last_round_of_the_last_batch_is_indexed_at_flush_cache():
    """SGLang erases the last batch's requests only on a later verify; flush_cache (our RL step
    boundary) must index their last round before ending the step."""
    worker = FakeNgramWorker(group_corpus(), tail=16)
    serve(worker, {FakeReq(rid_with_group("s0", PROMPT), PROMPT, 11): [list(r) for r in ROUNDS]})
    worker.clear_cache_pool()
    stats = worker.ngram_corpus.stats()
    assert (stats["final_tokens"], stats["steps"], stats["live_requests"]) == (3, 1, 0)
    later = FakeReq(rid_with_group("step1", PROMPT), PROMPT, 11)
    serve(worker, {later: [list(r) for r in ROUNDS]})
    assert worker.drafts[later.rid][2][:4] == [17, 18, 19, EOS]


def test_a_round_already_sent_by_overlap_scheduling_is_not_indexed_twice():
    """With overlap scheduling a finished request runs one more forward, whose batch_get already
    carries its last round (ngram_worker's ``prev_tokens`` splice): nothing is left to extend."""
    c = group_corpus()
    req = FakeReq("r", PROMPT, 11)
    req.commit([12, EOS, 77])
    c.track_requests([req])
    tokens = list(req.origin_input_ids_unpadded + req.output_ids)
    c.batch_get(["r"], [tokens], [len(tokens)])
    c.erase_match_state(["r"])
    stats = c.stats()
    assert (stats["final_tokens"], stats["live_requests"]) == (0, 0)


def test_a_tracked_request_that_does_not_match_is_refused_and_still_finished():
    c = group_corpus()
    c.track_requests([FakeReq("p", [1, 2, 3, 4, 5], 6)])  # 6 tokens: 3 new, only 1 of them output
    c.batch_get(["p"], [[1, 2, 3]], [3])
    with pytest.raises(ValueError, match="request 'p': 3 tokens after its last batch_get but only 1 output"):
        c.erase_match_state(["p"])
    assert c.stats()["live_requests"] == 0


def test_forward_hook_tracks_decode_batches_only_and_refuses_a_foreign_corpus():
    from rollout_spec.integrations.sglang import plugin

    worker = FakeNgramWorker(group_corpus(), tail=16)
    req = FakeReq("r", PROMPT, 11)
    assert plugin.track_batch_requests(worker, decode_batch([req], decode=False)) is None
    worker.ngram_corpus.batch_get(["r"], [PROMPT + [11]], [5])
    req.commit([12, EOS])
    worker.ngram_corpus.erase_match_state(["r"])
    assert worker.ngram_corpus.stats()["final_tokens"] == 0, "a prefill batch's requests are not tracked"
    worker.ngram_corpus = SimpleNamespace()  # SGLang's own NgramCorpus: our REPLACE did not apply
    with pytest.raises(RuntimeError, match="drafts with SimpleNamespace, not RolloutSpecCorpus"):
        plugin.track_batch_requests(worker, decode_batch([req]))


# ---------------------------------------------------------------- requests that finish at prefill
def prefill(worker: FakeNgramWorker, reqs: list[FakeReq]) -> None:
    """A prefill forward (our BEFORE hook runs on it too), then result processing: each request's
    first token, here the stop ``EOS`` for every request given."""
    from rollout_spec.integrations.sglang import plugin

    plugin.track_batch_requests(worker, decode_batch(reqs, decode=False))
    for req in reqs:
        req.commit([EOS])


def test_counters_count_only_what_the_drafter_took_after_a_refused_call():
    """NgramDrafter takes a batch call whole or not at all: after a refused extend the adapter's
    counters still match the drafter's index (a refused batch_get, erase_match_state or
    prefill-only indexing adds none of its refused tokens or requests)."""
    c = corpus()
    get(c, [[1, 2, 3]], rids=["a"])
    before = c.stats()
    with pytest.raises(ValueError, match=r"token ids in \[0, 2147483647\]"):
        c.batch_get(["a", "b"], [[1, 2, 3, 4], [5, -6]], [4, 2])  # b's start is refused
    after = c.stats()
    assert [after[k] - before[k] for k in ("requests", "committed_tokens", "index_tokens")] == [0, 0, 0]
    get(c, [[1, 2, 3, 4], [5, 6]], rids=["a", "b"])
    a, b = FakeReq("a", [1, 2], 3), FakeReq("b", [5], 6)
    a.commit([4, 7]), b.commit([-8])
    c.track_requests([a, b])
    before = c.stats()
    with pytest.raises(ValueError, match=r"token ids in \[0, 2147483647\]"):
        c.erase_match_state(["a", "b"])  # a's 7 is refused with b's -8
    after = c.stats()
    assert [after[k] - before[k] for k in ("final_tokens", "committed_tokens", "index_tokens")] == [0, 0, 0]
    short = FakeReq("short", [1, 2], None)
    c.track_prefill_requests([short])
    short.commit([-3, EOS])
    before = c.stats()
    with pytest.raises(ValueError, match=r"token ids in \[0, 2147483647\]"):
        c.track_requests([])  # its prompt was indexed, its output refused
    after = c.stats()
    assert [after[k] - before[k] for k in ("prefill_finished", "committed_tokens", "index_tokens")] == [0, 2, 2]


def test_a_request_that_finishes_at_prefill_is_indexed_for_later_requests():
    """A stop on the first token: the request never reaches a decode batch, so SGLang's worker
    never hands it to the corpus; the hook's next call (here the next decode forward) indexes its
    prompt and first token, and a request whose tail ends like that prompt drafts the stop."""
    worker = FakeNgramWorker(corpus(forward_hook=True), tail=16)
    prefill(worker, [FakeReq("short", PROMPT, None)])
    later = FakeReq("later", PROMPT[:-1], PROMPT[-1])
    serve(worker, {later: [[EOS]]})
    assert worker.drafts["later"][0][:2] == [PROMPT[-1], EOS]
    stats = worker.ngram_corpus.stats()
    assert (stats["prefill_finished"], stats["requests"]) == (1, 2)


def test_requests_finished_at_prefill_before_idling_are_indexed_at_flush_cache():
    worker = FakeNgramWorker(corpus(forward_hook=True), tail=16)
    prefill(worker, [FakeReq("a", PROMPT, None), FakeReq("b", [7, 8], None)])
    worker.clear_cache_pool()
    stats = worker.ngram_corpus.stats()
    assert (stats["prefill_finished"], stats["steps"], stats["committed_tokens"]) == (2, 1, 4 + 1 + 2 + 1)


def test_a_request_retracted_by_a_paused_flush_resumes_under_its_rid():
    """SGLang also flushes while generation is paused in retract mode (``Scheduler.flush_cache``,
    ``is_fully_idle(ignore_waiting=self._engine_paused)``): the running request is finished with
    what it committed, and when it resumes (same rid, prefilled again) it starts over from its
    tail in the new step, still drafting from its own history."""
    from rollout_spec.integrations.sglang import plugin

    worker = FakeNgramWorker(group_corpus(), tail=16)
    req = FakeReq(rid_with_group("s0", PROMPT), PROMPT, 11)
    rounds = [[12, 13, 14], [11, 12, 13], [14, 11, 12], [13, EOS]]
    for accepted in rounds[:2]:  # two rounds, then pause_generation(mode="retract") and flush
        plugin.track_batch_requests(worker, decode_batch([req]))
        worker.forward_batch_generation(decode_batch([req]))
        req.commit(accepted)
    worker.clear_cache_pool()
    stats = worker.ngram_corpus.stats()
    assert (stats["final_tokens"], stats["steps"], stats["live_requests"]) == (3, 1, 0)
    plugin.track_batch_requests(worker, decode_batch([req], decode=False))  # prefilled again
    serve(worker, {req: [list(r) for r in rounds[2:]]})
    stats = worker.ngram_corpus.stats()
    assert (stats["requests"], stats["restarts"], stats["prefill_finished"]) == (2, 0, 0)
    assert worker.drafts[req.rid][2][:3] == [13, 14, 11]  # after ...12, 13 it has seen 14, 11


def test_prefilled_requests_that_decode_or_were_retracted_are_not_indexed_at_prefill():
    """Overlap scheduling puts a prefill's requests in the next decode batch before their result
    is processed: the decode path owns them. A retracted request prefilled again has output."""
    from rollout_spec.integrations.sglang import plugin

    worker = FakeNgramWorker(corpus(forward_hook=True), tail=16)
    fresh, retracted = FakeReq("fresh", PROMPT, None), FakeReq("retracted", PROMPT, 11)
    plugin.track_batch_requests(worker, decode_batch([fresh, retracted], decode=False))
    plugin.track_batch_requests(worker, decode_batch([fresh]))  # before the prefill's result
    worker.forward_batch_generation(decode_batch([fresh]))
    fresh.commit([EOS])
    retracted.commit([EOS])
    worker.clear_cache_pool()
    stats = worker.ngram_corpus.stats()
    assert (stats["prefill_finished"], stats["requests"]) == (0, 1)


def test_drafting_while_the_forward_hook_never_ran_is_refused_by_name():
    """SGLang only logs a hook it fails to apply; the corpus it builds (forward_hook defaults to
    True) refuses to draft rather than lose last rounds and prefill-only requests unseen."""
    c = RolloutSpecCorpus(max_trie_depth=12, draft_token_num=D)  # as SGLang's worker builds it
    with pytest.raises(RuntimeError, match=r"forward hook on NGRAMWorker.forward_batch_generation has never run"):
        c.batch_get(["r"], [[1, 2, 3]], [3])
    assert c.stats()["requests"] == 0
    c.track_requests([])  # the hook ran (e.g. for a batch of other requests)
    c.batch_get(["r"], [[1, 2, 3]], [3])
    RolloutSpecCorpus(draft_token_num=D, forward_hook=False).batch_get(["r"], [[1, 2, 3]], [3])
    with pytest.raises(TypeError, match="forward_hook must be a bool, got int 1"):
        RolloutSpecCorpus(forward_hook=1)


def test_plugin_registers_the_forward_hook_next_to_the_corpus(monkeypatch):
    import sys

    from rollout_spec.integrations.sglang import plugin

    registered = []
    hook_type = SimpleNamespace(REPLACE="replace", BEFORE="before")
    registry = SimpleNamespace(register=lambda *args: registered.append(args))
    monkeypatch.setitem(sys.modules, "sglang.srt.plugins.hook_registry",
                        SimpleNamespace(HookRegistry=registry, HookType=hook_type))
    monkeypatch.setenv(ENV_VAR, "{}")
    assert plugin.register() is True
    assert registered == [
        (plugin.CORPUS_TARGET, RolloutSpecCorpus, "replace"),
        (plugin.FORWARD_TARGET, plugin.track_batch_requests, "before"),
    ]


@needs_sglang_source
def test_sglangs_before_wrapper_runs_the_hook_then_the_forward_unchanged():
    """SGLang's own wrapper (``_wrap_fn`` in srt/plugins/hook_registry.py, loaded from its file as
    the package's runtime does not import here) calls our hook with the worker and batch."""
    from rollout_spec.integrations.sglang import plugin

    spec = importlib.util.spec_from_file_location("sglang_hook_registry", SGLANG_DIR / "srt/plugins/hook_registry.py")
    registry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(registry)
    forward = registry._wrap_fn(FakeNgramWorker.forward_batch_generation, plugin.track_batch_requests,
                                registry.HookType.BEFORE)
    worker = FakeNgramWorker(group_corpus(), tail=16)
    req = FakeReq("r", PROMPT, 11)
    forward(worker, decode_batch([req]))
    req.commit([12, 13, EOS, 77])
    worker.clear_cache_pool()
    assert len(worker.drafts["r"]) == 1 and worker.ngram_corpus.stats()["final_tokens"] == 3


UPSTREAM_FILES = ("srt/speculative/ngram_worker.py", "srt/plugins/__init__.py", "srt/plugins/hook_registry.py",
                  "srt/managers/scheduler.py", "srt/managers/schedule_batch.py")


@needs_sglang_source
@pytest.mark.parametrize("rel, old, new, problem", [
    ("srt/speculative/ngram_worker.py", "def forward_batch_generation(", "def forward(",
     "no NGRAMWorker.forward_batch_generation to hook"),
    ("srt/speculative/ngram_worker.py", "self, batch: ScheduleBatch, on_publish", "self, schedule_batch, on_publish",
     "no longer takes (self, batch, ...)"),
    ("srt/speculative/ngram_worker.py", "self.ngram_corpus.erase_match_state(", "self.ngram_corpus.forget(",
     "no longer calls ngram_corpus.erase_match_state"),
    ("srt/managers/schedule_batch.py", "def output_ids_through_stop(", "def output_until_stop(",
     "no longer defines Req.output_ids_through_stop"),
    ("srt/managers/schedule_batch.py", "def finished(self)", "def is_done(self)",
     "no longer defines Req.finished"),
    ("srt/plugins/hook_registry.py", 'BEFORE = "before"', 'PRE = "before"', "no HookType.BEFORE"),
])
def test_shape_check_covers_the_forward_hook(tmp_path: Path, rel, old, new, problem):
    for name in UPSTREAM_FILES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(SGLANG_DIR / name, tmp_path / name)
    assert upstream_problems(tmp_path) == []
    edited = tmp_path / rel
    assert old in edited.read_text()
    edited.write_text(edited.read_text().replace(old, new))
    assert any(problem in p for p in upstream_problems(tmp_path)), upstream_problems(tmp_path)

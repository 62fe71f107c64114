"""Capacity under a 10M-token stream, and one thread extending while another proposes."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from rollout_spec.config import SpecConfig
from rollout_spec.drafter import NgramDrafter


def test_memory_stays_bounded_while_10m_tokens_stream_in():
    capacity = 1 << 19
    d = NgramDrafter(SpecConfig(capacity_tokens=capacity, history_steps=2))
    d.start_batch([0, 1], [[1, 2, 3], [4, 5, 6]], [0, 1])  # live requests are never evicted
    rng = np.random.default_rng(1)
    streamed, peak_after_fill = 0, 0
    chunk_lengths = np.full(200, 1000)
    while streamed < 10_000_000:
        tokens = rng.integers(0, 32_000, int(chunk_lengths.sum()), dtype=np.int32)
        bounds = np.concatenate([[0], np.cumsum(chunk_lengths)])
        seqs = [tokens[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        groups = [int(g) if g < 64 else None for g in rng.integers(0, 640, len(seqs))]
        d.add_sequences(groups, seqs)
        streamed += len(tokens)
        stats = d.stats()
        assert stats["index_tokens"] <= capacity
        if streamed <= 2 * capacity:
            peak_after_fill = max(peak_after_fill, stats["memory_bytes"])
        else:
            # steady state: memory does not creep beyond what the first fills needed
            assert stats["memory_bytes"] <= 1.5 * peak_after_fill
        if streamed % 2_000_000 == 0:
            d.end_step()
    stats = d.stats()
    assert stats["evictions"] > 0 and stats["num_requests"] == 2
    assert stats["memory_bytes"] < 400 * capacity  # bytes per stored token, indexes included
    d.check_integrity()
    d.extend(0, [1, 2])
    assert d.propose([0, 1]).num_requests == 2


@pytest.mark.parametrize("propose_threads", [1, 4])
def test_one_thread_extends_while_another_proposes(propose_threads):
    # 64 requests: with 4 threads every propose runs on the core's pool while extends queue.
    d = NgramDrafter(SpecConfig(capacity_tokens=4096, propose_threads=propose_threads))
    ids = list(range(64))
    d.start_batch(ids, [[i % 7, 1, 2] for i in ids], [i % 8 for i in ids])
    errors: list[BaseException] = []
    stop = threading.Event()

    def extender():
        rng = np.random.default_rng(2)
        try:
            for _ in range(300):
                d.extend_batch(ids, [rng.integers(0, 12, rng.integers(1, 4)) for _ in ids])
        except BaseException as e:  # surfaced in the main thread
            errors.append(e)
        finally:
            stop.set()

    def proposer():
        try:
            while not stop.is_set():
                b = d.propose(ids)
                b.validate()
                assert b.num_requests == len(ids)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=extender), threading.Thread(target=proposer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert d.stats()["evictions"] >= 0
    d.check_integrity()
    assert d.propose(ids).num_nodes > 0


def _replay(background: bool, seed: int = 3) -> list[tuple]:
    """A lock-step workload (two groups, capacity small enough to evict, an RL step boundary):
    every proposal and the final stats, extending with or without ``background``."""
    d = NgramDrafter(SpecConfig(capacity_tokens=3000, history_steps=1, num_draft_tokens=6))
    rng = np.random.default_rng(seed)
    seen, next_id = [], 0
    for _ in range(3):  # RL steps
        ids = list(range(next_id, next_id + 12))
        next_id += 12
        d.start_batch(ids, [[i % 3, 7, 8, 9] for i in ids], [i % 2 for i in ids])
        for _ in range(60):
            batch = d.propose(ids, [int(b) for b in rng.integers(0, 7, len(ids))])
            seen.append((batch.offsets.tolist(), batch.tokens.tolist(), batch.parents.tolist(),
                         batch.probs.tolist()))
            lists = [rng.integers(0, 20, int(rng.integers(1, 4))).tolist() for _ in ids]
            d.extend_batch(ids, lists, background=background)
        d.finish_batch(ids)
        d.end_step()
    d.check_integrity()
    stats = d.stats()
    return seen + [tuple(sorted((k, v) for k, v in stats.items() if isinstance(v, int)))]


def test_background_indexing_changes_no_proposal_and_no_state():
    """``extend_batch(background=True)`` returns before indexing; every later call waits for it,
    so proposals, evictions and stats match the plain extend's exactly."""
    assert _replay(background=True) == _replay(background=False)


def test_background_extend_checks_its_input_before_returning():
    """Bad ids raise at the call itself with nothing changed, and the drafter stays usable."""
    d = NgramDrafter(SpecConfig())
    d.start_batch([1, 2], [[1, 2, 3], [1, 2, 3]], [0, 0])
    d.extend_batch([1], [[4, 5]], background=True)
    before = d.stats()
    with pytest.raises(ValueError, match="unknown request id 9"):
        d.extend_batch([1, 9], [[6], [7]], background=True)
    with pytest.raises(ValueError, match="repeat"):
        d.extend_batch([2, 2], [[6], [7]], background=True)
    for flag in (1, None, np.True_):
        with pytest.raises(TypeError, match="background must be a bool"):
            d.extend_batch([2], [[6]], background=flag)
    assert d.stats() == before
    d.extend_batch([2], [[4]], background=True)
    batch = d.propose([2])  # waits for the indexing: the sibling's continuation 4 -> 5 is found
    assert batch.tokens.tolist()[:1] == [5]


def test_background_extends_queue_behind_each_other_across_threads():
    """Background extends from one thread and proposals from another: the same final state as
    doing them in one thread (every call waits for the indexing before it)."""
    ids = list(range(32))

    def run(threaded: bool) -> dict:
        d = NgramDrafter(SpecConfig(capacity_tokens=1 << 16, propose_threads=2))
        d.start_batch(ids, [[i % 5, 1, 2] for i in ids], [i % 4 for i in ids])
        rng = np.random.default_rng(9)
        chunks = [[rng.integers(0, 9, 2).tolist() for _ in ids] for _ in range(200)]

        def extender() -> None:
            for lists in chunks:
                d.extend_batch(ids, lists, background=True)

        if threaded:
            t = threading.Thread(target=extender)
            t.start()
            while t.is_alive():
                d.propose(ids)
            t.join()
        else:
            extender()
        d.check_integrity()
        return {k: v for k, v in d.stats().items() if k != "proposals"}

    assert run(threaded=True) == run(threaded=False)


def test_propose_ahead_on_one_thread_while_another_extends_in_the_background():
    """An ahead proposal posted by another thread between a background extend's wait and its
    own post ran before that extend's indexing and re-pointed the requests it indexes: the
    index fell out of step with the sequences (the integrity check failed in every run)."""
    d = NgramDrafter(SpecConfig(propose_threads=1, capacity_tokens=1 << 30))
    rng = np.random.default_rng(0)
    writers, readers = list(range(4000)), [10**6, 10**6 + 1]
    d.start_batch(writers, [rng.integers(0, 50, 8).tolist() for _ in writers])
    d.start_batch(readers, [rng.integers(0, 50, 8).tolist() for _ in readers])
    errors: list[BaseException] = []
    stop = threading.Event()
    one_token = [[7]] * len(writers)

    def extender() -> None:
        try:
            for _ in range(600):
                d.extend_batch(writers, one_token, background=True)
        except BaseException as e:  # surfaced in the main thread
            errors.append(e)
        finally:
            stop.set()

    def proposer() -> None:
        try:
            while not stop.is_set():
                for _ in range(50):  # posts far more often than the extends run: one lands in each
                    d.propose_ahead(readers)
                d.propose(readers)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=extender, daemon=True), threading.Thread(target=proposer, daemon=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "the threads deadlocked"
    assert not errors, errors
    d.check_integrity()


def test_one_long_response_does_not_size_every_later_request_for_it():
    """A new request's own tables are sized ahead for a response as long as recent ones; one
    300k-token response made each of the next short requests reserve ~9 MB (16 GB at 512)."""
    d = NgramDrafter(SpecConfig(capacity_tokens=1 << 22))
    d.start(0, [1, 2, 3])
    d.extend(0, (np.arange(300_000) % 1000).astype(np.int32))
    d.finish(0)
    before = d.stats()["memory_bytes"]
    d.start_batch(list(range(1, 21)), [[1, 2, 3, 4, 5]] * 20)
    assert d.stats()["memory_bytes"] - before < 20 * (1 << 20)
    d.check_integrity()


def test_sequences_without_tokens_are_not_kept():
    """An empty ingested sequence, or a request finished without a token, holds nothing to draft
    from and never counts towards capacity, so eviction would never free it: it is freed at once
    (400k of them grew memory by 25 MB at a capacity of 1,024 tokens)."""
    d = NgramDrafter(SpecConfig(capacity_tokens=1024, history_steps=0))
    d.add_sequences([3], [[1, 2, 3]])
    for round_ in range(20):
        d.add_sequences([None, 3] * 500, [[]] * 1000)
        ids = list(range(round_ * 500, (round_ + 1) * 500))
        d.start_batch(ids, [[]] * 500, group_ids=[3] * 500)
        d.finish_batch(ids)
        if round_ == 0:
            after_first = d.stats()["memory_bytes"]
    stats = d.stats()
    assert stats["num_sequences"] == 1 and stats["index_tokens"] == 3
    assert stats["memory_bytes"] <= after_first
    d.check_integrity()
    d.start(10**6, [1, 2])  # the freed slots are reused
    assert d.propose([10**6]).tokens.tolist()[:1] == [3]
    d.check_integrity()

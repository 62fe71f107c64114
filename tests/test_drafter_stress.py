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

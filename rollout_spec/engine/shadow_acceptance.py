"""Acceptance measured on plain steps, at no GPU cost: shadow proposals checked against the output.

While the budget keeps drafting off, its acceptance estimate would only move on probes, i.e.
drafting steps taken at a loss to learn whether drafting pays again. A shadow proposal learns the
same thing for the price of a proposal on the drafter's worker: every few plain steps, a few
running requests get a draft tree at their current output length, and once their outputs have
grown past it, the tree is walked along the tokens they actually emitted.

Why the walk measures what verification would accept: with drafted tokens fixed, the
verification law (``verify.py``) accepts child c of a reached node with probability
p(c) / (mass not yet rejected), trying children in order -- which is exactly the chance that a
token drawn from p equals c and no earlier child. So the accepted path of a tree has the law of
the path that plain samples walk through it, and a plain step's output is such a sample. (A
request that stops before the tree's depth ends the walk where a verify step would cut it.)

One tree measures every draft size at once: the drafter emits nodes best first, so its first k
nodes are what it would propose at budget k, and their walk is the walk's first nodes with an
index below k (the path's indices increase).

Rounds run on drafting steps too (``drafting_step``): a drafting step measures only the size it
offered, so without them a budget that drafts 8 nodes every step would never learn whether 32
pay more -- it stays at whatever size the prior picked first.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable

import numpy as np

from rollout_spec.config import check_int
from rollout_spec.drafter import unverified_propose
from rollout_spec.engine.commit import RunningBatch
from rollout_spec.engine.drafter_queue import DrafterQueue
from rollout_spec.engine.sequence import Sequence
from rollout_spec.replay import accepted_path
from rollout_spec.tree import drafter_output


class ShadowAcceptance:
    """Shadow proposals for ``requests`` running requests (round-robin) per round, each with
    ``budget`` draft nodes, and their outcome once the outputs caught up.

    The engine starts a round (``propose``) on a plain step right after handing the drafter
    every committed token, and on every ``every``-th drafting step right after its proposal
    (``drafting_step``), both while the GPU runs the step's forward, and collects finished
    walks with ``harvest`` as ``accepted[r, k]``: the nodes request r would have kept from its
    first k, k = 0 .. budget. Requests with less room than ``budget`` more tokens are left out
    (their trees would be cut short).
    """

    def __init__(self, budget: int, requests: int = 16, every: int = 8) -> None:
        self.budget = check_int("budget", budget, 1, 4096)
        self.requests = check_int("requests", requests, 1, 1 << 20)
        self.every = check_int("every", every, 1, 1 << 20)
        self._cursor = 0
        self._drafting_steps = 0  # drafting steps since the last round on one
        # (sequences, their output lengths when proposed, the proposal's future)
        self._pending: list[tuple[list[Sequence], list[int], Future]] = []
        self.rounds = 0

    def drafting_step(self) -> bool:
        """Count one drafting step; True on every ``every``-th (a round is due on it)."""
        self._drafting_steps += 1
        if self._drafting_steps < self.every:
            return False
        self._drafting_steps = 0
        return True

    def propose(self, queue: DrafterQueue, drafter: Any, seqs: list[Sequence], run: RunningBatch,
                max_model_len: int) -> None:
        """Queue one round's proposal. The drafter must have been handed every token of ``seqs``
        (and nothing after ``run``'s output lengths) by the calls queued before this one."""
        n = len(seqs)
        idx = (self._cursor + np.arange(min(self.requests, n))) % n
        self._cursor = (self._cursor + len(idx)) % n
        idx = idx[run.room(max_model_len)[idx] > self.budget]  # room for the tree and a bonus
        if not len(idx):
            return
        future = queue.call(unverified_propose(drafter), run.req_id[idx].tolist(), np.full(len(idx), self.budget))
        self._pending.append(([seqs[i] for i in idx], run.out_len[idx].tolist(), future))
        self.rounds += 1

    def drop_pending(self) -> None:
        """Forget the rounds not harvested yet (their call failed: its requests never finish)."""
        self._pending = []

    def harvest(self, observe: Callable[[np.ndarray], None]) -> None:
        """Walk every finished round whose requests emitted ``budget`` tokens since (or finished)
        and pass ``observe(accepted)`` (see the class); rounds not ready yet stay pending."""
        waiting = []
        sizes = np.arange(self.budget + 1)
        for entry in self._pending:
            seqs, starts, future = entry
            if not future.done() or not all(s.finished or len(s.output) - a >= self.budget
                                            for s, a in zip(seqs, starts)):
                waiting.append(entry)
                continue
            batch = drafter_output(future.result(), np.full(len(seqs), self.budget))
            off = batch.offsets.tolist()
            toks, pars = batch.tokens.tolist(), batch.parents.tolist()
            accepted = np.zeros((len(seqs), self.budget + 1), np.int64)
            for i, (s, a) in enumerate(zip(seqs, starts)):
                lo, hi = off[i], off[i + 1]
                path = accepted_path(toks[lo:hi], pars[lo:hi], s.output[a:a + self.budget])
                accepted[i] = np.searchsorted(path, sizes)  # path nodes with an index below k
            observe(accepted)
        self._pending = waiting

"""Feeding the drafter: in order, optionally on one worker thread, deferred while not drafting.

The engine feeds the drafter after every step (``extend`` with the committed tokens, ``start``
for admitted samples, ``finish`` for ended ones). ``DrafterQueue`` runs those calls in the
engine's order, either at once or (``overlap=True``) on a single FIFO worker thread, so that the
C++ drafter, which releases the GIL, can work while the main thread does something else.
Anything that reads the drafter's state (``propose``, ``stats``, ``end_step``) first waits for
the queue to empty, which keeps every proposal -- and so every output -- identical to the
synchronous engine's. ``DrafterFeed`` decides when the tokens go: at once after a drafting step,
deferred to the next proposal after a plain one.

The worker only helps while the main thread waits (a GPU sync) or runs C code without the GIL.
Each queued call needs the GIL to start and to convert its arguments, and a thread asking for
the GIL gets it only when the holder blocks or after the interpreter's switch interval (5 ms by
default): a call queued while the main thread works would start only when it next blocks.
``responsive()`` shortens the interval while the engine generates, so the worker takes over
within a fraction of a millisecond. The engine turns the overlap on where the model runs on CUDA
(its forward is asynchronous, so verification waits for the GPU while the worker extends) and
off on CPU, where the hand-offs cost more than they hid (measured on a loaded 2-core host); it
uses the worker for plain steps' hand-offs only (``RolloutEngine``'s ``overlap_drafter``).
"""
from __future__ import annotations

import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from typing import Any, Callable, Optional

from rollout_spec.drafter import background_kwargs
from rollout_spec.engine.sequence import Sequence


class DrafterQueue:
    """Ordered asynchronous drafter calls; ``overlap=False`` runs every call at once (same results).

    ``wait_seconds`` accumulates the time the main thread spent waiting in ``drain``: the part of
    the drafter's bookkeeping that the overlap did not hide.
    """

    max_pending = 16  # queued calls before ``submit`` waits (a few steps of extend + finish)
    switch_interval = 2e-4  # seconds; the interpreter's GIL switch interval inside ``responsive``

    def __init__(self, overlap: bool = False) -> None:
        self.overlap = overlap
        self.threaded = overlap  # whether calls go to the worker now (``use_worker``)
        self._pool: Optional[ThreadPoolExecutor] = None
        self._pending: list[Future] = []
        self.wait_seconds = 0.0

    def use_worker(self, on: bool) -> None:
        """Send the next calls to the worker (never without ``overlap``) or run them at once;
        switching the worker off first waits for it, so calls still run in submission order."""
        on = on and self.overlap
        if self.threaded and not on:
            self.drain()
        self.threaded = on

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` after every earlier submission (now, while the worker is off)."""
        if not self.threaded:
            fn(*args)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-spec-drafter")
        if len(self._pending) >= self.max_pending:
            # Calls that ended well need no waiting; a failed one stays for ``drain`` to raise.
            self._pending = [f for f in self._pending if not f.done() or f.exception() is not None]
            if len(self._pending) >= self.max_pending:  # a worker slower than the steps: wait
                self.drain()
        self._pending.append(self._pool.submit(fn, *args))

    def call(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Queue ``fn(*args)`` behind the pending calls and return its future (result or error)."""
        if not self.threaded:
            fut: Future = Future()
            try:
                fut.set_result(fn(*args))
            except BaseException as err:  # surfaced by fut.result(), like the threaded path
                fut.set_exception(err)
            return fut
        self.submit(fn, *args)
        return self._pending[-1]

    @contextmanager
    def responsive(self) -> Iterator[None]:
        """With the overlap on, lower the interpreter's GIL switch interval to
        ``switch_interval`` (never raise it) for the duration, then restore it."""
        old = sys.getswitchinterval()
        if self.overlap and self.switch_interval < old:
            sys.setswitchinterval(self.switch_interval)
        try:
            yield
        finally:
            sys.setswitchinterval(old)

    @property
    def busy(self) -> bool:
        """True while some submitted call has not finished."""
        return any(not f.done() for f in self._pending)

    def drain(self) -> None:
        """Wait for every submitted call; re-raise the first error one of them raised."""
        if not self._pending:
            return
        import time

        t0 = time.perf_counter()
        # waits for each, in order; an interrupt (Ctrl-C) leaves them pending, so the next drain
        # still waits for the worker before the main thread calls the drafter itself
        errors = [f.exception() for f in self._pending]
        self._pending = []
        self.wait_seconds += time.perf_counter() - t0
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise RuntimeError(f"drafter call failed on the worker thread: {first!r}") from first

    def close(self) -> None:
        """Drain, then stop the worker thread (a later submit starts a new one)."""
        try:
            self.drain()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


class DrafterFeed:
    """Gives the drafter the engine's committed tokens: right away, or deferred to the next proposal.

    After a step that drafted, the next one most likely drafts too, so its tokens go to the
    drafter at once (the next proposal needs them); so do a plain step's when the budget has
    already said that the next step drafts. After other steps without drafts, feeding is
    pure overhead unless speculation switches back on, so the tokens stay in the sequences
    (``Sequence.fed`` counts the output tokens the drafter has) and ``ready`` hands them over
    in one batch before the next proposal; ``flush`` does so when a ``generate`` ends. The drafter sees
    the same tokens in the same order either way, so proposals do not change. Finishes always
    wait for the next hand-off: nothing reads the drafter before the next proposal, and with
    ``background`` (the n-gram drafter indexes a drafting step's extend on its own thread
    while the engine commits) a finish right away would wait for that indexing.
    """

    flush_every = 8  # plain steps between hand-offs on the worker (see ``due``)

    def __init__(self, queue: DrafterQueue) -> None:
        self.queue = queue
        self._plain_steps = 0  # plain steps recorded since the last flush
        # The distinct running lists of the deferred steps: every sample with deferred tokens
        # is in one of them (a plain step of the same list as the last adds nothing: O(1) per
        # plain step; their sequences are visited at the flush, while the GPU works).
        self._lists: list[list[Sequence]] = []
        self._finished: list[Sequence] = []

    @property
    def pending(self) -> bool:
        """True while some committed tokens or finishes have not been handed to the drafter."""
        return bool(self._lists or self._finished)

    def due(self) -> bool:
        """Whether a plain step should hand the deferred tokens over now (to the worker, or for
        a shadow round): every ``flush_every`` plain steps. Each hand-off costs Python work per running request (and
        the GIL, while verification waits for the GPU); batching steps divides that work, and
        a proposal after a run of plain steps still finds at most that many steps to catch up."""
        return self.pending and self._plain_steps >= self.flush_every

    def committed(self, drafter: Any, seqs: list[Sequence], kept: list[list[int]],
                  finished: list[Sequence], now: bool) -> None:
        """Record a step's kept tokens (not yet appended to ``seqs``) and the sequences it ended."""
        if not now:
            self._plain_steps += 1
            # The scheduler grows its running list in place and replaces it when samples end,
            # so a list seen before still holds everyone it held then.
            if not self._lists or seqs is not self._lists[-1]:
                self._lists.append(seqs)
            self._finished += finished
            return
        self.flush(drafter)  # keeps the drafter's order: older deferred tokens first
        # Indexed while the engine commits where the drafter can (``background_kwargs``); its
        # next call waits for that.
        extend = partial(drafter.extend_batch, **background_kwargs(drafter, True))
        self.queue.submit(extend, [s.req_id for s in seqs], kept)
        for s, toks in zip(seqs, kept):
            s.fed = len(s.output) + len(toks)
        # Finishes wait for the next proposal (or flush): a finish now would wait for the
        # background indexing, and nothing reads the drafter before then.
        self._finished += finished

    def flush(self, drafter: Any) -> None:
        """Queue every deferred extend (each request's unseen output) and finish."""
        if not self.pending:
            return
        ids, toks = [], []
        for seqs in self._lists:
            for s in seqs:
                size = len(s.output)
                if size > s.fed:  # a sequence in several lists is handed over once
                    ids.append(s.req_id)
                    toks.append(s.output[s.fed:])
                    s.fed = size
        if ids:
            self.queue.submit(drafter.extend_batch, ids, toks)
        if self._finished:
            self.queue.submit(drafter.finish_batch, [s.req_id for s in self._finished])
        self._lists, self._finished = [], []
        self._plain_steps = 0

    def ready(self, drafter: Any) -> None:
        """Before a proposal: everything committed has reached the drafter."""
        self.flush(drafter)
        self.queue.drain()

"""A drop-in for SGLang's NGRAM corpus (``NgramCorpus``) backed by rollout-spec's drafter.

SGLang's NGRAM worker calls, per decode step: ``synchronize``; ``batch_get(req_ids,
batch_tokens, total_lens)`` with the last few tokens of every running request and its full
length; ``batch_put`` with those same tails after verification; ``erase_match_state`` for
requests that left the batch; and ``reset`` from ``flush_cache``. Our drafter wants the whole
token stream of each request instead, so the adapter rebuilds it: a request's new tokens are the
last ``total_len - known_len`` of its tail. The tokens of a request's last verify round never
reach ``batch_get``: the plugin's hook hands the corpus each decode batch's SGLang ``Req`` objects
(``track_requests``), and ``erase_match_state`` reads the round from the final output of the
requests that left. The same hook hands it the fresh requests of prefill batches
(``track_prefill_requests``): one that finishes there never reaches the worker's corpus calls, and
is indexed from its ``Req`` once it has finished. The index is never wiped: ``reset`` (which verl
triggers at every weight update) is the RL step boundary, so history survives it.
"""
from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from rollout_spec.config import SpecConfig, check_int
from rollout_spec.integrations.sglang.config import spec_from_env
from rollout_spec.integrations.sglang.rid import group_from_rid
from rollout_spec.integrations.sglang.tree_format import leaf_paths, to_ids_mask
from rollout_spec.prompt_roots import PromptRoots
from rollout_spec.token_ids import MAX_TOKEN_ID, int_array

logger = logging.getLogger(__name__)

MATCH_TYPES = ("BFS", "PROB")
SEPARATOR_TOKEN = -(2**31)
"""What SGLang puts between the documents of an external corpus (``cpp_ngram/external_corpus.py``)."""
LOAD_BATCH_TOKENS = 1 << 16
"""External corpus tokens indexed per drafter call (whole documents, at least one): a decode step
that drafts while SGLang loads a corpus on its background thread waits for one such call (tens of
milliseconds), not for the whole corpus."""


@dataclass(slots=True)
class _Request:
    """What the adapter knows of one live SGLang request."""

    drafter_id: int  # our int id for SGLang's string rid
    known_len: int  # prompt + output tokens the drafter has seen the end of


@dataclass
class _Pending:
    """Starts and extends of one batch_get, sent to the drafter in two batched calls
    (``RolloutSpecCorpus._send``), and what they add to the counters once the drafter took them.

    Tokens are lists of Python ints as SGLang sends them, the form the drafter converts natively.
    """

    starts: list = field(default_factory=list)  # (drafter id, tokens, group id or None)
    start_tokens: int = 0  # tokens of the starts
    extend_ids: list = field(default_factory=list)  # drafter ids of the extended requests
    extend_tokens: list = field(default_factory=list)  # their new tokens, in the same order
    extended: int = 0  # new tokens of the extends that the tails hold
    gaps: int = 0  # new tokens of the extends that the tails no longer hold


class RolloutSpecCorpus:
    """SGLang's ``NgramCorpus`` interface over an ``NgramDrafter``.

    The constructor accepts SGLang's keywords so the worker can build it unchanged;
    ``draft_token_num`` fixes the output layout, ``external_corpus_max_tokens`` bounds external
    corpora, and the trie/BFS options of SGLang's own corpus are accepted but unused (our drafter
    is configured by ``spec``, by default from the ``ROLLOUT_SPEC_SGLANG`` variable).

    ``forward_hook`` (default True, as SGLang builds it) says the plugin's forward hook feeds
    ``track_requests``/``track_prefill_requests``: ``batch_get`` then refuses to draft while the
    hook has never run, since without it last verify rounds and prefill-only requests would be
    lost without a trace. Pass False to drive the corpus directly, without SGLang's worker.

    With ``spec.shared_index`` set, the drafter shares its index with the other replicas
    (``rollout_spec.distributed.share_drafter``; placement from ``ROLLOUT_SPEC_REPLICA_ID`` and
    ``ROLLOUT_SPEC_NUM_REPLICAS``): finished requests are recorded, ``reset`` publishes them.
    """

    def __init__(
        self,
        max_trie_depth: int = 18,
        min_bfs_breadth: int = 1,
        max_bfs_breadth: int = 8,
        draft_token_num: int = 8,
        match_type: str = "BFS",
        capacity: int = 1_000_000,
        external_sam_budget: int = 0,
        external_corpus_max_tokens: int = 10_000_000,
        *,
        spec: Optional[SpecConfig] = None,
        drafter: Any = None,
        forward_hook: bool = True,
    ) -> None:
        draft_token_num = check_int("draft_token_num", draft_token_num, 1)
        max_trie_depth = check_int("max_trie_depth", max_trie_depth, 1)
        external_corpus_max_tokens = check_int("external_corpus_max_tokens", external_corpus_max_tokens, 0)
        if match_type not in MATCH_TYPES:
            raise ValueError(f"match_type must be one of {MATCH_TYPES}, got {match_type!r}")
        if type(forward_hook) is not bool:
            raise TypeError(f"forward_hook must be a bool, got {type(forward_hook).__name__} {forward_hook!r}")
        if spec is None:
            spec = spec_from_env() or SpecConfig()
        if not isinstance(spec, SpecConfig):
            raise TypeError(f"spec must be a SpecConfig, got {type(spec).__name__}")
        if drafter is None:
            from rollout_spec.drafter import NgramDrafter

            drafter = NgramDrafter(spec)
        self.spec = spec
        self.drafter = _maybe_shared(drafter, spec)
        self.draft_token_num = draft_token_num
        self.max_trie_depth = max_trie_depth
        self.external_corpus_max_tokens = external_corpus_max_tokens
        self._budget = min(spec.num_draft_tokens, draft_token_num - 1)
        self._live: dict[str, _Request] = {}
        self._tracked: dict[str, Any] = {}  # SGLang Req of each rid of a decode batch, until it leaves
        self._prefilling: dict[str, Any] = {}  # fresh Reqs of prefill batches, until they decode or finish
        self._prompt_roots = PromptRoots()  # the groups of untagged rids, from their Req's prompt
        self.load_batch_tokens = LOAD_BATCH_TOKENS  # per drafter call of an external corpus load
        self._forward_hook = forward_hook
        self._hook_calls = 0  # track_requests + track_prefill_requests calls
        self._last_get: list[str] = []  # rids of the latest batch_get, to recognise batch_put
        self._last_tails: list[list[int]] = []  # and their tails
        self._next_id = 0
        self._corpora: dict[str, int] = {}
        self._uncommitted: dict[str, int] = {}  # loaded corpora awaiting SGLang's commit: tokens
        self._counters = dict(requests=0, gets=0, gap_tokens=0, restarts=0, steps=0,
                              put_sequences=0, put_skipped=0, committed_tokens=0,
                              final_tokens=0, prefill_finished=0)
        self._committed_since_step = 0

    # ------------------------------------------------------------ the worker's per-step calls
    def synchronize(self) -> None:
        """No-op: our drafter ingests synchronously, so every put is visible to the next get."""

    def batch_get(
        self, req_ids: Sequence[str], batch_tokens: Sequence[Sequence[int]], total_lens: Sequence[int]
    ) -> tuple[np.ndarray, np.ndarray]:
        """Draft trees for the running requests, as SGLang's flat ``(ids, mask)`` int64 arrays.

        ``batch_tokens[i]`` are the last tokens of request ``req_ids[i]`` and ``total_lens[i]`` its
        full length; tokens beyond what the drafter saw are committed to it before drafting.

        A rejected call changes nothing the adapter knows; should the drafter reject the tokens
        (e.g. ids out of range), the batch's requests are dropped, to start over on their next get.
        Counters count only what the drafter took (it takes a batch call whole or not at all).

        Raises:
            ValueError: lengths differ, a tail is empty, a total length is below its tail, or a
                request id repeats.
            RuntimeError: built with ``forward_hook`` but the hook has never run.
        """
        if self._forward_hook and not self._hook_calls:
            raise RuntimeError(
                "SGLang's NGRAM worker drafts (batch_get) but rollout-spec's forward hook on "
                "NGRAMWorker.forward_batch_generation has never run: SGLang did not apply it (look "
                "for 'Failed to apply hooks' in its log) or another worker method drafts. Without it "
                "last verify rounds and requests that finish at prefill are never indexed"
            )
        if not len(req_ids) == len(batch_tokens) == len(total_lens):
            raise ValueError(
                f"req_ids, batch_tokens and total_lens must have equal lengths, got "
                f"{len(req_ids)}, {len(batch_tokens)}, {len(total_lens)}"
            )
        if len(set(req_ids)) != len(req_ids):
            raise ValueError("req_ids must not repeat within one batch_get")
        tails = list(map(list, batch_tokens))  # copies: batch_put compares against them
        lens = list(map(int, total_lens))
        _check_tails(req_ids, tails, lens)
        pending = _Pending()
        try:
            drafter_ids = self._sync_batch(req_ids, tails, lens, pending)
            self._send(pending)
        except Exception:
            self._drop(req_ids)
            raise
        self._last_get, self._last_tails = list(req_ids), tails
        self._counters["gets"] += 1
        batch = self.drafter.propose(drafter_ids, [self._budget] * len(drafter_ids))
        return to_ids_mask(batch, [tail[-1] for tail in tails], self.draft_token_num)

    def batch_put(self, batch_tokens: Sequence[Sequence[int]]) -> None:
        """Add token sequences to the global scope.

        The worker puts back the very tails it just passed to ``batch_get`` (same order); those
        tokens already reach the drafter through their request, so they are recognised and
        skipped instead of being indexed again. Anything else is indexed as a new sequence.
        """
        fresh, skipped = [], 0
        rids, tails, live = self._last_get, self._last_tails, self._live
        for i, seq in enumerate(batch_tokens):
            tail = seq if type(seq) is list else list(seq)
            if i < len(rids) and rids[i] in live and tails[i] == tail:
                skipped += 1
            elif tail:
                fresh.append(tail)
        self._counters["put_skipped"] += skipped
        self._last_get, self._last_tails = [], []
        if fresh:
            self.drafter.add_sequences([None] * len(fresh), fresh)
            self._counters["put_sequences"] += len(fresh)
            self._committed_since_step += sum(map(len, fresh))

    def track_requests(self, reqs: Iterable[Any]) -> None:
        """Keep a decode batch's SGLang ``Req`` objects until their requests leave the batch.

        Called by the plugin's hook before each NGRAM ``forward_batch_generation``. The worker
        hands the corpus a round's accepted tokens only through the next ``batch_get``, so a
        request's last round would never reach the drafter; ``erase_match_state`` reads it from
        the request's final output instead. Requests tracked at their prefill that joined no
        decode batch and have finished are indexed here (``track_prefill_requests``).
        """
        self._hook_calls += 1
        reqs = list(reqs)
        for req in reqs:
            self._tracked[req.rid] = req
        if self._prefilling:  # usually empty: a request joins its first decode batch right away
            for req in reqs:
                self._prefilling.pop(req.rid, None)
            self._index_finished_prefills()

    def track_prefill_requests(self, reqs: Iterable[Any]) -> None:
        """Keep a prefill batch's fresh SGLang ``Req`` objects until they decode or finish.

        Called by the plugin's hook before each NGRAM ``forward_batch_generation`` of a batch that
        is not a decode. A request that finishes at its prefill (``max_new_tokens=1``, a stop on
        its first token) never reaches a decode batch, so the worker never hands it to the corpus;
        it is indexed at a later hook call or at ``reset``, once ``Req.finished()``. Requests with
        output already (retracted ones, prefilled again) are left to their decode path.
        """
        self._hook_calls += 1
        for req in reqs:
            if not len(req.output_ids) and req.rid not in self._live:
                self._prefilling[req.rid] = req
        self._index_finished_prefills()

    def erase_match_state(self, req_ids: Iterable[str]) -> None:
        """Finish requests that left the batch: their tokens stay in the group/global scopes.

        A tracked request's tokens committed after its last ``batch_get`` (its last verify round,
        cut at its stop as SGLang's ``Req.output_ids_through_stop`` says) are extended first.
        """
        rids = list(req_ids)
        try:
            self._extend_final_tokens([(rid, self._tracked.pop(rid, None)) for rid in rids])
        finally:
            self._finish_requests(rids)

    def reset(self) -> None:
        """SGLang's ``flush_cache``: an RL step boundary for us, never a wipe of the index.

        Live requests are finished. SGLang flushes when idle, and also while generation is
        paused in retract mode, its unfinished requests then retracted to the waiting queue
        (``Scheduler.flush_cache`` checks ``is_fully_idle(ignore_waiting=self._engine_paused)``);
        one that resumes keeps its rid and starts over from its tail at its next ``batch_get``.
        verl may flush more than once per weight update, so a step is ended only when tokens
        arrived since the last one (also when the drafter's ``end_step`` raised: a sharing
        drafter has aged by then).
        """
        self.erase_match_state(list(self._live))
        self._index_finished_prefills()
        self._prefilling.clear()  # none mid-prefill: idle, or retracted (prefilled anew)
        self._tracked.clear()
        self._last_get, self._last_tails = [], []
        if self._committed_since_step > 0:
            # counted first: a sharing drafter ages even when its publish raises, and a second
            # flush of the same step must not age it again
            self._committed_since_step = 0
            self._counters["steps"] += 1
            self.drafter.end_step()

    # ------------------------------------------------------------ request bookkeeping
    def _sync_batch(self, req_ids: Sequence[str], tails: list[list[int]], lens: list[int],
                    pending: _Pending) -> list[int]:
        """Queue in ``pending`` what the drafter lacks of each request (its non-empty tail within
        its total length, checked by ``batch_get``); returns their drafter ids.

        One plain loop over the batch: this runs for every request at every decode step, so the
        usual case (a live request with new tokens) inlines its bookkeeping. The ``known_len``
        it advances is dropped with the batch's requests should the drafter refuse them.
        """
        drafter_ids, live = [], self._live
        extend_ids, extend_tokens = pending.extend_ids, pending.extend_tokens
        committed = gaps = 0
        for rid, tail, total_len in zip(req_ids, tails, lens):
            req = live.get(rid)
            if req is None or total_len < req.known_len:
                drafter_ids.append(self._start_request(rid, req, tail, total_len, pending))
                continue
            new = total_len - req.known_len
            if new > 0:
                extend_ids.append(req.drafter_id)
                extend_tokens.append(tail[-new:])
                tail_len = len(tail)
                if new > tail_len:  # more tokens than the tail holds: the rest is a gap
                    gaps += new - tail_len
                    committed += tail_len
                else:
                    committed += new
            req.known_len = total_len
            drafter_ids.append(req.drafter_id)
        pending.extended, pending.gaps = committed, gaps
        return drafter_ids

    def _send(self, pending: _Pending) -> None:
        """Send the held starts, then the held extends, to the drafter as two batch calls, and
        count each call's requests and tokens once the drafter took them."""
        if pending.starts:
            ids, prompts, groups = zip(*pending.starts)
            self.drafter.start_batch(list(ids), list(prompts), list(groups))
            self._counters["requests"] += len(ids)
            self._commit(pending.start_tokens)
        if pending.extend_ids:
            self.drafter.extend_batch(pending.extend_ids, pending.extend_tokens)
            self._counters["gap_tokens"] += pending.gaps
            self._commit(pending.extended)

    def _start_request(self, rid: str, req: Optional[_Request], tail: list[int], total_len: int,
                       pending: _Pending) -> int:
        """Queue in ``pending`` the start of request ``rid`` from ``tail``: a new request
        (``req`` None) or one rolled back below what the drafter saw; returns its drafter id."""
        if req is not None:
            # The request was rolled back (e.g. retracted and re-run): start it over, still
            # tracked (its Req is the batch's), so its last round is read when it leaves.
            self._finish_requests([rid])
            self._counters["restarts"] += 1
        req = self._live[rid] = _Request(self._next_id, total_len)
        self._next_id += 1
        pending.starts.append((req.drafter_id, tail, self._group_of(rid, self._tracked.get(rid))))
        pending.start_tokens += len(tail)
        return req.drafter_id

    def _extend_final_tokens(self, leaving: list[tuple[str, Any]]) -> None:
        """Extend live requests with what their SGLang ``Req`` (None: untracked) committed after
        their last ``batch_get``, in one batch call; counted once the drafter took it. The
        ``known_len`` set here is never read if it refuses: the caller finishes these requests
        either way."""
        extends, new_tokens = [], 0
        for rid, sglang_req in leaving:
            req = self._live.get(rid)
            if req is None or sglang_req is None:
                continue
            output = sglang_req.output_ids_through_stop
            final_len = len(sglang_req.origin_input_ids_unpadded) + len(output)
            new = final_len - req.known_len
            if new <= 0:  # e.g. overlap scheduling, whose extra round went through batch_get
                continue
            if new > len(output):
                raise ValueError(
                    f"request {rid!r}: {new} tokens after its last batch_get but only {len(output)} "
                    "output tokens; the tracked Req is not the request drafted for"
                )
            extends.append((req.drafter_id, list(output[len(output) - new:])))
            req.known_len = final_len
            new_tokens += new
        if extends:
            ids, tokens = zip(*extends)
            self.drafter.extend_batch(list(ids), list(tokens))
            self._counters["final_tokens"] += new_tokens
            self._commit(new_tokens)

    def _index_finished_prefills(self) -> None:
        """Index the tracked prefill requests that finished: the last ``max_trie_depth`` tokens of
        their prompt (as many as a ``batch_get`` tail holds), then their output cut at its stop,
        as one started, extended and finished drafter request each (an empty output is not a
        response and is skipped)."""
        finished = [rid for rid, req in self._prefilling.items() if req.finished()]
        ids, prompts, groups, outputs = [], [], [], []
        for rid in finished:
            req = self._prefilling.pop(rid)
            output = list(req.output_ids_through_stop)
            if not output:
                continue
            ids.append(self._next_id)
            self._next_id += 1
            prompts.append(list(req.origin_input_ids_unpadded[-self.max_trie_depth:]))
            groups.append(self._group_of(rid, req))
            outputs.append(output)
        if not ids:
            return
        self.drafter.start_batch(ids, prompts, groups)
        self._counters["requests"] += len(ids)
        self._commit(sum(map(len, prompts)))
        try:
            self.drafter.extend_batch(ids, outputs)
        finally:  # started requests are finished even when the drafter rejects their tokens
            self.drafter.finish_batch(ids)
        self._counters["prefill_finished"] += len(ids)
        self._commit(sum(map(len, outputs)))

    def _group_of(self, rid: str, sglang_req: Any) -> Optional[int]:
        """The group a rid carries (``rid.rid_with_group``), else that of its SGLang ``Req``'s
        prompt (None: untracked, no group): the hash of its token ids, or of an earlier prompt it
        extends (a multi-turn client's next turn), as ``PromptRoots`` keeps them."""
        group = group_from_rid(rid)
        if group is None and sglang_req is not None:
            group = self._prompt_roots.group_of(sglang_req.origin_input_ids_unpadded)
        return group

    def _finish_requests(self, req_ids: Sequence[str]) -> None:
        """Finish the live requests among ``req_ids`` in the drafter and forget them."""
        done = [self._live.pop(rid).drafter_id for rid in req_ids if rid in self._live]
        if done:
            self.drafter.finish_batch(done)

    def _drop(self, req_ids: Sequence[str]) -> None:
        """Forget requests whose tokens the drafter rejected, finishing those it has started, so
        their next ``batch_get`` starts them over instead of failing on a half-known request."""
        dropped = [self._live.pop(rid).drafter_id for rid in req_ids if rid in self._live]
        started = [i for i in dropped if self.drafter.is_live(i)]
        if started:
            self.drafter.finish_batch(started)

    def _commit(self, count: int) -> None:
        self._counters["committed_tokens"] += count
        self._committed_since_step += count

    # ------------------------------------------------------------ external corpora (SGLang API)
    @property
    def remaining_token_budget(self) -> int:
        """Tokens external corpora may still add (``external_corpus_max_tokens`` minus loaded)."""
        # list(): SGLang's load thread may add a pending corpus while another thread reads this
        return (self.external_corpus_max_tokens - sum(list(self._corpora.values()))
                - sum(list(self._uncommitted.values())))

    def load_external_corpus_named(self, corpus_id: str, chunks: Iterable[Sequence[int]]) -> int:
        """Index a corpus into the global scope, pinned (never aged or evicted, as SGLang keeps its
        own until removed); returns how many tokens were loaded, separators included as SGLang
        counts them.

        SGLang streams one token sequence in fixed-size chunks, documents after the first opening
        with ``SEPARATOR_TOKEN`` (``cpp_ngram/external_corpus.py``, and its ``documents`` API):
        the chunks are joined and split at the separators, one stored sequence per document.
        Every token is checked first; the documents then go in by ``load_batch_tokens``, the
        drafter's lock released between batches, so drafting goes on during a run-time load.

        Raises:
            ValueError: ``corpus_id`` is loaded already (committed or not), the chunks exceed the
                token budget, hold a value that is neither a token id in [0, 2**31 - 1] nor the
                separator, or hold no document token (SGLang's corpus refuses an empty one too).
            TypeError: a chunk is not a 1-D sequence of integers.
        """
        if corpus_id in self._corpora or corpus_id in self._uncommitted:
            raise ValueError(f"external corpus {corpus_id!r} is loaded already")
        stream = _corpus_stream(corpus_id, chunks)
        total = len(stream)
        if total > self.remaining_token_budget:
            raise ValueError(
                f"external corpus {corpus_id!r} has {total} tokens, over the remaining budget "
                f"of {self.remaining_token_budget} (external_corpus_max_tokens)"
            )
        docs = _documents(stream)
        if not docs:
            raise ValueError(f"external corpus {corpus_id!r} holds no tokens; SGLang refuses an empty corpus too")
        for batch in _load_batches(docs, self.load_batch_tokens):
            self.drafter.add_sequences([None] * len(batch), batch, pinned=True)
        self._uncommitted[corpus_id] = total
        return total

    def commit_external_corpus_load(self, corpus_id: str, loaded_token_count: int) -> None:
        """Record a loaded corpus (SGLang calls this with what ``load_external_corpus_named``
        returned). The count is what the budget and ``list_external_corpora`` report, so it must
        be the one loaded: another would let later corpora past ``external_corpus_max_tokens``.

        Raises:
            ValueError: ``corpus_id`` was not loaded or is committed already, or
                ``loaded_token_count`` is not the count its load returned.
            TypeError: ``loaded_token_count`` is not an integer.
        """
        loaded = self._uncommitted.get(corpus_id)
        if loaded is None:
            raise ValueError(f"external corpus {corpus_id!r} has no load to commit "
                             "(load_external_corpus_named first, and commit it once)")
        count = check_int("loaded_token_count", loaded_token_count, 0)
        if count != loaded:
            raise ValueError(f"loaded_token_count of external corpus {corpus_id!r} must be {loaded}, "
                             f"the count its load returned, got {count}")
        self._corpora[corpus_id] = self._uncommitted.pop(corpus_id)

    def remove_external_corpus(self, corpus_id: str) -> None:
        """Not supported: the drafter's index cannot take back one corpus's tokens.

        Raises:
            NotImplementedError: always; restart the server without the corpus instead.
        """
        raise NotImplementedError(
            f"rollout-spec's corpus cannot remove external corpus {corpus_id!r}: its tokens are "
            "merged into the global index; restart the server without it"
        )

    def list_external_corpora(self) -> dict[str, int]:
        """Loaded external corpora and their token counts."""
        return dict(self._corpora)

    # ------------------------------------------------------------ inspection
    def leaf_paths_from_mask(self, tokens: list[int], tree_mask: list[list[int]]) -> list[list[int]]:
        """Root-to-leaf token paths of one request's tree (SGLang's debugging helper)."""
        return leaf_paths(tokens, tree_mask)

    def stats(self) -> dict[str, Any]:
        """Adapter counters (requests, gaps, skipped puts, steps, ``final_tokens``: last verify
        rounds' tokens indexed as requests left, ``prefill_finished``: requests indexed that
        finished at their prefill) merged with the drafter's stats."""
        return {**self._counters, "live_requests": len(self._live), **self.drafter.stats()}


def _check_tails(req_ids: Sequence[str], tails: list[list[int]], lens: list[int]) -> None:
    """Raise unless every tail is non-empty and within its request's total length.

    Raises:
        ValueError: naming the first request whose tail is empty or longer than its total length.
    """
    tail_lens = list(map(len, tails))
    if 0 not in tail_lens and not any(map(operator.lt, lens, tail_lens)):
        return
    for rid, tail_len, total_len in zip(req_ids, tail_lens, lens):
        if not tail_len:
            raise ValueError(f"batch_tokens for request {rid!r} is empty; SGLang always sends >= 1 token")
        if total_len < tail_len:
            raise ValueError(f"total_lens for request {rid!r} is {total_len}, below its {tail_len} tokens")


def _maybe_shared(drafter: Any, spec: SpecConfig) -> Any:
    """The drafter, wrapped to share its index when ``spec.shared_index`` is set.

    Raises:
        ValueError: SGLang runs tensor parallel. Every rank drafts for itself and the ranks must
            propose identical trees, which a background ingest at rank-dependent times breaks.
    """
    if spec.shared_index is None:
        return drafter
    from rollout_spec.distributed.sharing import SharingDrafter, share_drafter

    if isinstance(drafter, SharingDrafter):
        return drafter
    if _tensor_parallel_size() > 1:
        raise ValueError(
            "SpecConfig.shared_index is not supported with SGLang tensor parallelism (tp_size > 1): "
            "each rank drafts on its own and background ingestion would make their drafts differ"
        )
    return share_drafter(drafter, spec, None)


def _tensor_parallel_size() -> int:
    """SGLang's tensor-parallel world size in this scheduler process (1 outside SGLang)."""
    try:
        from sglang.srt.distributed.parallel_state import get_tensor_model_parallel_world_size

        return int(get_tensor_model_parallel_world_size())
    except (ImportError, AssertionError, RuntimeError):  # no SGLang, or no TP group in this process
        return 1


def _corpus_stream(corpus_id: str, chunks: Iterable[Sequence[int]]) -> np.ndarray:
    """SGLang's chunks of an external corpus joined into one int32 array, each value checked to be
    a token id or ``SEPARATOR_TOKEN`` (errors name the chunk and the position in it)."""
    name = f"external corpus {corpus_id!r}"
    parts = []
    for i, chunk in enumerate(chunks):
        part = int_array(f"{name} chunk {i}", chunk, SEPARATOR_TOKEN, MAX_TOKEN_ID, kind="token ids")
        bad = np.flatnonzero((part < 0) & (part != SEPARATOR_TOKEN))
        if bad.size:
            raise ValueError(f"{name} chunk {i} holds {int(part[bad[0]])} at position {int(bad[0])}: "
                             f"not a token id in [0, {MAX_TOKEN_ID}] nor the separator {SEPARATOR_TOKEN}")
        parts.append(part.astype(np.int32, copy=False))
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


def _documents(stream: np.ndarray) -> list[np.ndarray]:
    """The non-empty documents of a corpus stream, split at (and without) its separators."""
    cuts = np.flatnonzero(stream == SEPARATOR_TOKEN)
    starts = np.concatenate(([0], cuts + 1))
    ends = np.concatenate((cuts, [len(stream)]))
    return [stream[a:b] for a, b in zip(starts.tolist(), ends.tolist()) if b > a]


def _load_batches(docs: list[np.ndarray], batch_tokens: int) -> Iterable[list[np.ndarray]]:
    """``docs`` in order, in runs of whole documents that reach ``batch_tokens`` tokens (the last
    run may hold fewer; a document longer than that is a run of its own)."""
    batch, size = [], 0
    for doc in docs:
        batch.append(doc)
        size += len(doc)
        if size >= batch_tokens:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch

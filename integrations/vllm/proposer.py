"""The vLLM speculative proposer backed by rollout-spec's n-gram/suffix drafter.

vLLM builds it through its ``custom_class`` speculative method (``speculative_config.model`` =
this class's dotted path). vLLM's own call for that method passes no request ids, and our drafter
keeps per-request and per-group state, so ``rollout_spec.integrations.vllm.plugin`` routes the
GPU model runner's draft step to ``propose_for_runner``, which reads request ids, prompts and
sampling params from the runner. Nothing in this file imports vLLM.
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np

from rollout_spec.integrations.vllm.chains import best_chains, explicit_group_id
from rollout_spec.integrations.vllm.config import (
    GROUP_ID_EXTRA_ARG,
    placement_from_vllm_config,
    spec_from_vllm_config,
)
from rollout_spec.config import SpecConfig
from rollout_spec.prompt_roots import PromptRoots

GroupLookup = Callable[[str, Optional[np.ndarray]], Optional[int]]
"""A request's group from its id and prompt token ids (None: its prompt is not known as token ids)."""


@dataclasses.dataclass(frozen=True)
class StopRule:
    """The token-level stop conditions of one request, as vLLM's scheduler applies them to each
    output token in turn (``check_stop``, vllm/v1/core/sched/utils.py).

    ``check_stop`` tests the stop ids before ``min_tokens`` (vLLM 0.29 and 0.33): its sampler
    masks them until then, but for a structured-output request whose grammar allows nothing
    else it restores them, and a stop id sampled there stops the request all the same.

    Not covered: vLLM's ``stop`` strings, matched by its detokenizer in the front-end process
    (which then aborts the request), and its ``repetition_detection`` pattern check. The tokens
    sampled after one of those stops, until vLLM's finish reaches the runner, reach the drafter.
    """

    stop_ids: frozenset[int]  # the EOS id (unless ignore_eos) and stop_token_ids
    max_tokens: int  # the request is length-capped at this many output tokens

    @classmethod
    def from_sampling_params(cls, params: Any) -> "StopRule":
        """From a vLLM ``SamplingParams`` as a worker holds it (the engine has filled in
        ``max_tokens``, the model's EOS id and its generation config's extra EOS ids)."""
        ids = set(params.stop_token_ids or ())
        if not params.ignore_eos and params.eos_token_id is not None:
            ids.add(params.eos_token_id)
        return cls(frozenset(int(t) for t in ids), int(params.max_tokens))


StopLookup = Callable[[str], StopRule]


@dataclasses.dataclass(slots=True)
class _Request:
    """What the proposer tracks of one request the drafter holds."""

    known: int  # row positions (prompt + output) taken in; an unknown prompt's count as taken
    stop: Optional[StopRule]  # read once, when the request starts; None: nothing is cut


class RolloutSpecProposer:
    """Drafts chains for vLLM from one ``NgramDrafter`` per worker process.

    Request ids (strings in vLLM) map to fresh ints; a request starts in the drafter on its first
    sampled token, is extended with every committed token (read from the runner's token table,
    so tokens of steps where vLLM skipped the draft step arrive with the next one) up to the one
    that stops it (EOS, a stop token id, ``max_tokens``, ``max_model_len``: ``StopRule``), and
    finishes at that token, when vLLM's scheduler reports it finished (``update_states``, every
    step) or when the trainer signals the RL step boundary (``end_step``).

    With ``SpecConfig.shared_index`` set and ``share_index`` true (the worker whose drafts vLLM
    uses), the drafter is wrapped by ``rollout_spec.distributed.share_drafter``: finished samples
    are published at ``end_step`` and other replicas' are ingested in the background (one
    data-parallel engine per replica: a replica never pulls its own publications back).
    """

    def __init__(self, vllm_config: Any, drafter: Optional[Any] = None, share_index: bool = True) -> None:
        self.spec: SpecConfig = spec_from_vllm_config(vllm_config)
        self.num_speculative_tokens = int(vllm_config.speculative_config.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        if drafter is None:
            from rollout_spec.drafter import NgramDrafter

            drafter = NgramDrafter(self.spec)
        if share_index and self.spec.shared_index is not None:
            from rollout_spec.distributed.sharing import share_drafter

            dp = int(getattr(getattr(vllm_config, "parallel_config", None), "data_parallel_size", 1))
            if dp > 1:
                raise ValueError(
                    f"shared_index needs data_parallel_size=1, got {dp}: each data-parallel engine "
                    "drafts with its own index, and all would publish as this one replica, so none "
                    "would learn the others' samples of its groups")

            drafter = share_drafter(drafter, self.spec, placement_from_vllm_config(vllm_config))
        self.drafter = drafter
        self._ids: dict[str, int] = {}  # drafter id by vLLM request id
        self._live: dict[str, _Request] = {}  # the same requests' state
        self._stopped: set[str] = set()  # finished at our stop rule, not yet by vLLM: not restarted
        self._next_id = 0
        self._prompt_roots = PromptRoots()  # a later turn's group: the prompt it extends
        self.counters = {"requests_started": 0, "requests_finished": 0, "rows_drafted": 0,
                         "chain_tokens_proposed": 0, "steps_ended": 0}

    # -- vLLM entry points ------------------------------------------------------------------
    def propose(self, *args: Any, **kwargs: Any) -> list[list[int]]:
        """vLLM's plain custom_class call; it carries no request ids, so it cannot be served.

        Raises:
            RuntimeError: always -- the plugin that routes drafting to ``propose_for_runner`` is
                not active in this process (entry point not installed, or VLLM_PLUGINS omits it).
        """
        raise RuntimeError(
            "RolloutSpecProposer was called through vLLM's plain custom_class path: the "
            "'rollout_spec' vllm.general_plugins entry point is not active in this worker. "
            "Reinstall rollout-spec (pip install -e .) and, if VLLM_PLUGINS is set, add "
            "'rollout_spec' to it."
        )

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """No weights: the drafter is model-free (vLLM calls this for every proposer)."""

    def update_states(self, runner: Any, scheduler_output: Any) -> None:
        """The runner's per-step state update (every step, also those that skip the draft step
        or run no forward), before vLLM's own: the requests vLLM's scheduler reports finished get
        what the drafter has not seen of their tokens (committed in skipped draft steps, still in
        the runner's token table) up to the token that stopped them, and are finished.

        A request the drafter holds that the scheduler lists as new is a streaming-input
        (``resumable``) session's next input chunk: vLLM never reports its stop in
        ``finished_req_ids`` and rebuilds its row under the same id: the output it kept (not its
        last sampled token) now prompt, then the new input, and the chunk's sampling params (the
        runner's ``_update_streaming_request``). It is finished as if reported, and starts over
        from the rebuilt row at its next draft step.

        A request finished at our stop rule is not started again while vLLM runs it on (vLLM 0.29
        caps a streaming session's every chunk by its first chunk's ``max_tokens``, where the rule
        reads the chunk's own): it waits, undrafted, until vLLM reports it finished or lists it as
        new, or ``end_step``. Started anew at every step, it would index its whole row each time.

        A scheduled request whose output the scheduler reports shorter than what the drafter
        holds had tokens discarded after our draft step saw them (a failed KV load: vLLM's own
        update truncates the runner's copy next): it is finished and starts over, from the
        runner's token table, at its next draft step. Its stale copy, as any finished request's,
        stays in the group and global indexes (the drafter has no call that takes tokens back).
        """
        batch = runner.input_batch
        new_ids = [new.req_id for new in scheduler_output.scheduled_new_reqs]
        self._stopped.difference_update(scheduler_output.finished_req_ids)
        self._stopped.difference_update(new_ids)
        next_chunks = [rid for rid in new_ids if rid in self._ids]
        # in the batch's row order: a set's order moves with the hash seed, and the drafts with it
        done = sorted({*scheduler_output.finished_req_ids, *next_chunks},
                      key=lambda r: (batch.req_id_to_index.get(r, sys.maxsize), r))
        ids, tails, extended = [], [], []
        for rid in done:
            row = batch.req_id_to_index.get(rid)
            if rid not in self._ids or row is None:
                continue
            req = self._live[rid]
            tail = batch.token_ids_cpu[row, req.known:int(batch.num_tokens_no_spec[row])].tolist()
            tail, _ = self._kept(tail, req.known, int(batch.num_prompt_tokens[row]), req.stop)
            if tail:
                ids.append(self._ids[rid])
                tails.append(tail)
                extended.append(req)
        if ids:
            self.drafter.extend_batch(ids, tails)
            _record_extended(extended, tails)
        self.finish(done)
        cached = scheduler_output.scheduled_cached_reqs
        live, requests = self._live, runner.requests
        self.finish([
            rid for rid, kept in zip(cached.req_ids, cached.num_output_tokens)
            if rid in live and requests[rid].num_prompt_tokens + kept < live[rid].known
        ])

    def propose_for_runner(
        self, runner: Any, scheduler_output: Any, sampled_token_ids: Sequence[Sequence[int]]
    ) -> list[list[int]]:
        """Draft for every row of the GPU model runner's persistent batch (one chain per row);
        each request's stop rule comes from its sampling params.

        Chains hold at most the scheduler's ``num_spec_tokens_to_schedule``: its
        ``num_speculative_tokens_per_batch_size`` schedule may set it below
        ``num_speculative_tokens``, down to 0 (no drafts this step, as vLLM's own ngram proposer
        gives none then).
        """
        k = min(int(scheduler_output.num_spec_tokens_to_schedule), self.num_speculative_tokens)
        batch = runner.input_batch
        return self.propose_rows(
            list(batch.req_ids), sampled_token_ids, batch.num_tokens_no_spec,
            batch.num_prompt_tokens, batch.token_ids_cpu,
            _runner_group_lookup(runner, self._prompt_roots), k,
            stop_of=lambda rid: StopRule.from_sampling_params(runner.requests[rid].sampling_params),
            is_token_ids=getattr(batch, "is_token_ids", None),
        )

    # -- engine-independent core --------------------------------------------------------------
    def propose_rows(
        self,
        req_ids: Sequence[str],
        sampled_token_ids: Sequence[Sequence[int]],
        num_tokens: np.ndarray,
        num_prompt_tokens: np.ndarray,
        token_ids: np.ndarray,
        group_of: GroupLookup,
        k: int,
        stop_of: Optional[StopLookup] = None,
        is_token_ids: Optional[np.ndarray] = None,
    ) -> list[list[int]]:
        """Commit each row's new tokens to the drafter and return its best chain (<= k tokens).

        Rows with no sampled token (a prefill chunk) or at the model's length limit get no draft,
        nor does any row when ``k`` is 0.
        ``token_ids[i, :num_tokens[i]]`` is row i's prompt followed by its committed output; what
        the drafter has not seen of it is committed, not only this step's ``sampled_token_ids``:
        vLLM skips the draft step for the whole batch when a row nears ``max_model_len``.

        vLLM's runner writes every token its rejection sampler accepted into that table, also
        those after a token that stops the request; its scheduler drops them only after this
        step. So a row is committed up to and including the first token at which vLLM stops the
        request (by ``stop_of(req_id)``, read once when the request starts, or ``max_model_len``;
        without ``stop_of`` nothing is cut); that row gets no draft and is finished here.

        ``is_token_ids`` (vLLM's ``InputBatch.is_token_ids``, same shape as ``token_ids``; None:
        every position holds a token id) marks the positions given as token ids. A request whose
        prompt has any position given as an embedding (``prompt_embeds``) starts with an empty
        prompt: vLLM leaves such positions unwritten (stale ids of the row's earlier requests) or
        holding a placeholder id, so neither drafting from them nor hashing them into a group
        would mean anything (``_start_row``).
        """
        num_rows = len(req_ids)
        drafts: list[list[int]] = [[] for _ in range(num_rows)]
        # One plain loop per batch, as lists of Python ints: this runs for every row at every
        # decode step, and reading numpy scalars row by row cost more than the row's bookkeeping.
        # The tails stay lists of Python ints, the form the drafter converts natively.
        ends, prompt_lens = num_tokens[:num_rows].tolist(), num_prompt_tokens[:num_rows].tolist()
        ids_of, live, max_len = self._ids, self._live, self.max_model_len
        rows, ids, caps = [], [], []  # the rows drafted for
        new_ids, tails, extended, stopped = [], [], [], []
        for i, (rid, new) in enumerate(zip(req_ids, sampled_token_ids)):
            n = ends[i]
            if len(new) == 0 or n >= max_len:
                continue
            p = prompt_lens[i]
            int_id = ids_of.get(rid)
            if int_id is None:
                if rid in self._stopped:
                    continue  # vLLM runs on past where our stop rule ended it (see update_states)
                prompt = token_ids[i, :p]
                if is_token_ids is not None and not is_token_ids[i, :p].all():
                    prompt = None
                int_id = self._start_row(rid, prompt, p, group_of, stop_of)
            req = live[rid]
            known = req.known
            tail, stops = self._kept(token_ids[i, known:n].tolist(), known, p, req.stop)
            new_ids.append(int_id)
            tails.append(tail)
            extended.append(req)
            if stops:
                stopped.append(rid)
                continue
            rows.append(i)
            ids.append(int_id)
            room = max_len - n - 1
            caps.append(k if k < room else room)  # min(k, room), without a builtin call per row
        if new_ids:
            self.drafter.extend_batch(new_ids, tails)
            _record_extended(extended, tails)
        self._stopped.update(stopped)
        if not ids or k <= 0:
            self.finish(stopped)
            return drafts
        chains = best_chains(self.drafter.propose(ids), caps)
        self.finish(stopped)
        for i, chain in zip(rows, chains):
            drafts[i] = chain
        self.counters["rows_drafted"] += sum(map(bool, chains))
        self.counters["chain_tokens_proposed"] += sum(map(len, chains))
        return drafts

    def finish(self, req_ids: Iterable[str]) -> None:
        """Mark requests done; their tokens stay in the group and global indexes."""
        done = []
        for r in req_ids:
            if r in self._ids:
                done.append(self._ids.pop(r))
                del self._live[r]
        if done:
            self.drafter.finish_batch(done)
            self.counters["requests_finished"] += len(done)

    def end_step(self) -> dict[str, Any]:
        """RL step boundary (new policy weights): finish what is left, age the drafter's
        indexes, and return the counters so the trainer can log them."""
        self.finish(list(self._ids))
        self._stopped.clear()
        self.drafter.end_step()
        self.counters["steps_ended"] += 1
        return self.stats()

    def stats(self) -> dict[str, Any]:
        """This proposer's counters plus the drafter's own statistics under ``drafter/``."""
        raw = self.drafter.stats()
        if dataclasses.is_dataclass(raw):
            raw = dataclasses.asdict(raw)
        drafter_stats = {f"drafter/{k}": v for k, v in dict(raw or {}).items()}
        return {**self.counters, "active_requests": len(self._ids), **drafter_stats}

    def _kept(self, tail: list[int], start: int, num_prompt: int,
              stop: Optional[StopRule]) -> tuple[list[int], bool]:
        """What vLLM keeps of a request's tokens ``tail`` (from position ``start`` of its row in
        the runner's token table), and whether it stops the request there: up to and including
        the first token at which ``check_stop`` would: a stop id, ``max_tokens`` output tokens or
        ``max_model_len`` tokens, whatever ``min_tokens`` says (``StopRule``)."""
        if stop is None:
            return tail, False
        # the usual tail (every row, every step): its last token is below both length caps,
        # and it holds no stop id
        end = start + len(tail)
        if (end < self.max_model_len and end - num_prompt < stop.max_tokens
                and stop.stop_ids.isdisjoint(tail)):
            return tail, False
        for j, token in enumerate(tail):
            length = start + j + 1  # the request's tokens once this one is in
            out = length - num_prompt  # and its output tokens
            if (length >= self.max_model_len or out >= stop.max_tokens
                    or token in stop.stop_ids):
                return tail[: j + 1], True
        return tail, False

    def _start_row(self, req_id: str, prompt: Optional[np.ndarray], num_prompt: int,
                   group_of: GroupLookup, stop_of: Optional[StopLookup]) -> int:
        """Start request ``req_id`` in the drafter from its row's ``prompt`` (``num_prompt``
        positions; None: not known as token ids, so it starts empty, in the group ``group_of``
        gives it without a prompt); returns its drafter id. All output so far follows as the
        row's tail: this covers requests seen mid-flight."""
        stop = stop_of(req_id) if stop_of is not None else None  # before the drafter knows it
        group = group_of(req_id, prompt)
        int_id = self._start(req_id, _EMPTY_PROMPT if prompt is None else prompt, group)
        self._live[req_id] = _Request(known=num_prompt, stop=stop)
        return int_id

    def _start(self, req_id: str, prompt: np.ndarray, group_id: Optional[int]) -> int:
        int_id = self._next_id
        self._next_id += 1
        self.drafter.start(int_id, np.asarray(prompt, dtype=np.int32), group_id=group_id)
        self._ids[req_id] = int_id
        self.counters["requests_started"] += 1
        return int_id


_EMPTY_PROMPT = np.zeros(0, dtype=np.int32)


def _record_extended(requests: list[_Request], tails: list[list[int]]) -> None:
    """Count ``tails`` as held by the drafter, once its ``extend_batch`` took them.

    ``NgramDrafter.extend_batch`` checks every id and token before it stores any, so a refused
    call leaves every request as it was; counting before the call would make the next step skip
    the tokens the drafter never got.
    """
    for req, tail in zip(requests, tails):
        req.known += len(tail)


def _runner_group_lookup(runner: Any, roots: PromptRoots) -> GroupLookup:
    """Group of a request: ``extra_args['rollout_spec_group']`` when the caller set it, else a
    hash of the prompt tokens (the n samples of a prompt share it, in this step and later ones),
    or of the earlier prompt in ``roots`` that this one extends (a multi-turn agent's next turn,
    sent as prompt + output + tool output, drafts with its first turn's group). A prompt not
    known as token ids (None: given as embeddings) has no group unless the caller set one: a hash
    of its row's placeholder ids would put every such prompt of a length in one group."""

    def lookup(req_id: str, prompt: Optional[np.ndarray]) -> Optional[int]:
        state = runner.requests.get(req_id)
        params = getattr(state, "sampling_params", None)
        extra = getattr(params, "extra_args", None) or {}
        if GROUP_ID_EXTRA_ARG in extra:
            return explicit_group_id(extra[GROUP_ID_EXTRA_ARG])
        return None if prompt is None else roots.group_of(prompt)

    return lookup

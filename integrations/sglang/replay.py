"""Replay recorded GRPO rollouts through ``RolloutSpecCorpus`` the way SGLang's NGRAM worker calls it.

Lock-step: every live request takes one verify per iteration; a draft slot is accepted when it
continues the accepted path with the recorded next token, then one bonus token is committed.
A step's requests first go through one prefill batch, handed to ``track_prefill_requests`` as the
plugin's forward hook does, which commits their first token; a response of one token ends there
and is indexed by the corpus at the next hook call (or at ``reset``), as SGLang's would. Before
each verify the batch's requests are handed to ``track_requests``, so a request's last round is
indexed when it leaves: as SGLang's worker does, the requests that left the batch are erased after
the next verify's ``batch_put``, and those of the last batch at ``reset()`` (verl's
``flush_cache``), which ends each RL step. Prints, per step, the responses that finished at their
prefill (prefill-only: indexed, but no verify), the tokens committed by verifies, tokens per
verify (TPF, over those tokens and verifies only), SGLang's acceptance (accepted / verified slots)
and the adapter's CPU cost.

    python -m rollout_spec.integrations.sglang.replay ../shared/traces/grpo_smollm2_t0.6.json.gz
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import numpy as np

from rollout_spec.cli_args import DefaultsParser, check_trace_responses, int_arg, load_trace_arg
from rollout_spec.config import SpecConfig
from rollout_spec.integrations.sglang.corpus import RolloutSpecCorpus
from rollout_spec.integrations.sglang.rid import rid_with_group
from rollout_spec.replay import Trace

MAX_RESPONSES = 1 << 20  # the bench scripts' bound on requests per step


def accepted_length(ids: np.ndarray, mask: np.ndarray, truth: list[int]) -> int:
    """Draft slots accepted along the recorded continuation ``truth`` (greedy tree walk)."""
    d = len(ids)
    ancestors = mask.astype(bool) & ~np.eye(d, dtype=bool)
    parent = np.where(ancestors.any(1), d - 1 - np.argmax(ancestors[:, ::-1], axis=1), -1)
    node, n = 0, 0
    while n < len(truth):
        kids = np.flatnonzero((parent == node) & (ids == truth[n]))
        if len(kids) == 0:
            break
        node, n = int(kids[0]), n + 1
    return n


@dataclass
class ReplayedRequest:
    """The fields of SGLang's ``Req`` that the corpus reads at its prefill and when it leaves: its
    prompt, its output so far (a recorded response ends at its stop, so nothing lies past one)
    and whether it finished."""

    rid: str
    origin_input_ids_unpadded: list[int]
    response: list[int]
    committed: int = 0  # the prefill commits token 0

    @property
    def output_ids(self) -> list[int]:
        """The tokens committed so far."""
        return self.response[: self.committed]

    @property
    def output_ids_through_stop(self) -> list[int]:
        """The tokens committed so far (none lies past the recorded stop)."""
        return self.output_ids

    def finished(self) -> bool:
        """Whether the whole recorded response is committed."""
        return self.committed >= len(self.response)


def replay_step(corpus: RolloutSpecCorpus, step: int, prompts: dict[int, list[int]],
                responses: list[tuple[int, list[int]]], tail: int) -> dict:
    """One RL step of lock-step decoding of ``(group_id, response_ids)`` pairs (a ``Trace`` step);
    returns its totals and the adapter's seconds.

    ``adapter_s`` is the process's CPU time in the corpus calls, as ``rollout_spec.replay`` times
    a drafter: it counts the drafter's propose threads (wall time would miss their share) and not
    the time the process waits for a CPU.

    ``verifies``, ``accepted`` and ``generated`` count decode steps only: a response's first token
    comes from its prefill. ``prefill_only`` counts the responses that end there (one token, or
    none): they take no verify, so TPF (``generated / verifies``) leaves them out, but the corpus
    indexes them (its ``prefill_finished`` counter), as SGLang's forward hook has it do.
    """
    d = corpus.draft_token_num
    requests = [ReplayedRequest(rid_with_group(f"s{step}-{i}", prompts[g]), prompts[g], response)
                for i, (g, response) in enumerate(responses)]
    t0 = time.process_time()
    corpus.track_prefill_requests(requests)  # the hook's call before the prefill batch's forward
    adapter_s = time.process_time() - t0
    for r in requests:
        r.committed = min(1, len(r.response))  # the prefill's token
    live = {r.rid: r for r in requests if not r.finished()}
    prefill_only = len(requests) - len(live)
    verifies = accepted = generated = 0
    departed: list[str] = []  # requests that left at the latest verify
    while live:
        rids = list(live)
        tails = [(r.origin_input_ids_unpadded + r.output_ids_through_stop)[-tail:] for r in live.values()]
        lens = [len(r.origin_input_ids_unpadded) + r.committed for r in live.values()]
        t0 = time.process_time()
        corpus.track_requests(live.values())
        ids, mask = corpus.batch_get(rids, tails, lens)
        corpus.batch_put(tails)
        if departed:  # NGRAMWorker.forward_batch_generation erases them after the next verify's put
            corpus.erase_match_state(departed)
        adapter_s += time.process_time() - t0
        ids, mask = ids.reshape(-1, d), mask.reshape(-1, d, d)
        done = []
        for b, rid in enumerate(rids):
            r = live[rid]
            a = accepted_length(ids[b], mask[b], r.response[r.committed:])
            # a <= tokens left; the bonus token exists only when the response goes on past the drafts
            step_tokens = min(a + 1, len(r.response) - r.committed)
            r.committed += step_tokens
            verifies, accepted, generated = verifies + 1, accepted + a, generated + step_tokens
            if r.finished():
                done.append(rid)
        for rid in done:
            del live[rid]
        departed = done
    corpus.reset()  # flush_cache: the last batch's requests are erased only here, as in SGLang
    return dict(verifies=verifies, accepted=accepted, generated=generated,
                prefill_only=prefill_only, adapter_s=adapter_s)


def load_replayed_trace(parser: argparse.ArgumentParser, path: str, max_responses: int) -> Trace:
    """The trace at ``path`` with every step cut to its first ``max_responses`` responses (0: all).
    What is left is checked as ``load_trace_arg`` checks a whole trace: no responses, or no token
    in any of them, is an argument error (else no rows, or rows of 0/0), and a step of only empty
    responses is named in a note on stderr, the cut named with the trace."""
    if not max_responses:
        return load_trace_arg(parser, "trace", path, need_responses=True)
    trace = load_trace_arg(parser, "trace", path).first_responses(max_responses)
    check_trace_responses(parser, "trace", f"{path} (--max-responses {max_responses})", trace)
    return trace


def step_row(step: int, responses: int, totals: dict, num_draft_tokens: int) -> str:
    """One printed row of ``replay_step``'s ``totals``; a step without a verify (each of its
    responses ends at its prefill, or is empty) has no TPF, acceptance or cost per verify: "-"."""
    head = f"{step:>4} {responses:>9} {totals['prefill_only']:>12} {totals['generated']:>8} "
    verifies = totals["verifies"]
    if not verifies:
        return head + f"{'-':>6} {'-':>11} {'-':>11}"
    return head + (f"{totals['generated'] / verifies:>6.2f} "
                   f"{totals['accepted'] / (verifies * num_draft_tokens):>11.3f} "
                   f"{1e6 * totals['adapter_s'] / verifies:>11.1f}")


def main(argv: list[str] | None = None) -> None:
    """Replay a trace file and print one row per RL step."""
    ap = DefaultsParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="trace in the shared format (gzip JSON when it ends in .gz)")
    ap.add_argument("--num-draft-tokens", type=int_arg("--num-draft-tokens", 1, 1024), default=8,
                    help="draft budget")
    ap.add_argument("--tail", type=int_arg("--tail", 1, 1 << 20), default=64, help="speculative_ngram_max_trie_depth")
    ap.add_argument("--max-responses", type=int_arg("--max-responses", 0, MAX_RESPONSES), default=0,
                    help="first N responses per step (0: all)")
    args = ap.parse_args(argv)
    trace = load_replayed_trace(ap, args.trace, args.max_responses)
    spec = SpecConfig(num_draft_tokens=args.num_draft_tokens)
    # SGLang's worker sends tails of speculative_ngram_max_trie_depth tokens, and the corpus
    # starts a prefill-only request from as many of its prompt's last tokens.
    corpus = RolloutSpecCorpus(max_trie_depth=args.tail, draft_token_num=args.num_draft_tokens + 1,
                               spec=spec)
    print(f"{'step':>4} {'responses':>9} {'prefill-only':>12} {'tokens':>8} {'TPF':>6} "
          f"{'accept/slot':>11} {'us/req/step':>11}")
    for step, responses in enumerate(trace.steps):
        totals = replay_step(corpus, step, trace.prompts, responses, args.tail)
        print(step_row(step, len(responses), totals, args.num_draft_tokens))


if __name__ == "__main__":
    main()

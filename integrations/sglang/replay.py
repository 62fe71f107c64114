"""Replay recorded GRPO rollouts through ``RolloutSpecCorpus`` the way SGLang's NGRAM worker calls it.

Lock-step: every live request takes one verify per iteration; a draft slot is accepted when it
continues the accepted path with the recorded next token, then one bonus token is committed.
Before each verify the batch's requests are handed to ``track_requests``, as the plugin's forward
hook does, so a request's last round is indexed when it leaves. Each RL step ends with
``reset()`` (verl's ``flush_cache``). Prints, per step, tokens per verify
(TPF), SGLang's acceptance (accepted / verified slots) and the adapter's CPU cost.

    python -m rollout_spec.integrations.sglang.replay ../shared/traces/grpo_smollm2_t0.6.json.gz
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import numpy as np

from rollout_spec.cli_args import int_arg, load_trace_arg
from rollout_spec.config import SpecConfig
from rollout_spec.integrations.sglang.corpus import RolloutSpecCorpus
from rollout_spec.integrations.sglang.rid import rid_with_group


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
    """The fields of SGLang's ``Req`` that the corpus reads when a request leaves: its prompt and
    its output so far (a recorded response ends at its stop, so nothing lies past one)."""

    rid: str
    origin_input_ids_unpadded: list[int]
    response: list[int]
    committed: int = 1  # token 0 comes from the prefill

    @property
    def output_ids_through_stop(self) -> list[int]:
        """The tokens committed so far."""
        return self.response[: self.committed]


def replay_step(corpus: RolloutSpecCorpus, step: int, prompts: dict[int, list[int]],
                responses: list[tuple[int, list[int]]], tail: int) -> dict:
    """One RL step of lock-step decoding of ``(group_id, response_ids)`` pairs (a ``Trace`` step);
    returns its totals (decode steps only: a response's first token comes from its prefill) and
    the adapter's seconds."""
    d = corpus.draft_token_num
    live: dict[str, ReplayedRequest] = {}
    for i, (group_id, response) in enumerate(responses):
        if len(response) <= 1:  # finished at its prefill: SGLang's NGRAM worker never sees it
            continue
        prompt = prompts[group_id]
        rid = rid_with_group(f"s{step}-{i}", prompt)
        live[rid] = ReplayedRequest(rid, prompt, response)
    verifies = accepted = generated = 0
    adapter_s = 0.0
    while live:
        rids = list(live)
        tails = [(r.origin_input_ids_unpadded + r.output_ids_through_stop)[-tail:] for r in live.values()]
        lens = [len(r.origin_input_ids_unpadded) + r.committed for r in live.values()]
        t0 = time.perf_counter()
        corpus.track_requests(live.values())
        ids, mask = corpus.batch_get(rids, tails, lens)
        corpus.batch_put(tails)
        adapter_s += time.perf_counter() - t0
        ids, mask = ids.reshape(-1, d), mask.reshape(-1, d, d)
        done = []
        for b, rid in enumerate(rids):
            r = live[rid]
            a = accepted_length(ids[b], mask[b], r.response[r.committed:])
            # a <= tokens left; the bonus token exists only when the response goes on past the drafts
            step_tokens = min(a + 1, len(r.response) - r.committed)
            r.committed += step_tokens
            verifies, accepted, generated = verifies + 1, accepted + a, generated + step_tokens
            if r.committed >= len(r.response):
                done.append(rid)
        for rid in done:
            del live[rid]
        t0 = time.perf_counter()
        corpus.erase_match_state(done)
        adapter_s += time.perf_counter() - t0
    corpus.reset()
    return dict(verifies=verifies, accepted=accepted, generated=generated, adapter_s=adapter_s)


def main(argv: list[str] | None = None) -> None:
    """Replay a trace file and print one row per RL step."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="trace in the shared format (gzip JSON when it ends in .gz)")
    ap.add_argument("--num-draft-tokens", type=int_arg("--num-draft-tokens", 1, 1024), default=8,
                    help="draft budget")
    ap.add_argument("--tail", type=int_arg("--tail", 1), default=64, help="speculative_ngram_max_trie_depth")
    ap.add_argument("--max-responses", type=int_arg("--max-responses", 0), default=0,
                    help="first N responses per step (0: all)")
    args = ap.parse_args(argv)
    trace = load_trace_arg(ap, "trace", args.trace)
    spec = SpecConfig(num_draft_tokens=args.num_draft_tokens)
    corpus = RolloutSpecCorpus(draft_token_num=args.num_draft_tokens + 1, spec=spec)
    print(f"{'step':>4} {'responses':>9} {'tokens':>8} {'TPF':>6} {'accept/slot':>11} {'us/req/step':>11}")
    for step, responses in enumerate(trace.steps):
        responses = responses[: args.max_responses] if args.max_responses else responses
        r = replay_step(corpus, step, trace.prompts, responses, args.tail)
        print(f"{step:>4} {len(responses):>9} {r['generated']:>8} {r['generated'] / max(r['verifies'], 1):>6.2f} "
              f"{r['accepted'] / max(r['verifies'] * args.num_draft_tokens, 1):>11.3f} "
              f"{1e6 * r['adapter_s'] / max(r['verifies'], 1):>11.1f}")


if __name__ == "__main__":
    main()

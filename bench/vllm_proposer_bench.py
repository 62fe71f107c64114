"""Replay rollout traces through the vLLM proposer as vLLM's GPU model runner calls it, and print
its CPU cost per request per step. Runs without vLLM: the runner's objects are plain stand-ins
with the attribute names the proposer reads (as in tests/test_integration_vllm.py).

    python bench/vllm_proposer_bench.py --trace T.json.gz --max-live 512
    python bench/vllm_proposer_bench.py --max-live 256 --tree --digest drafts.json

Each engine step, lock-step over one RL step's responses: the scheduler admits waiting requests
into free rows (up to --max-live), the runner's state update runs (``update_states``: last step's
finishes, the scheduled requests' output counts), then removes the finished rows, adds the new
ones and condenses the batch as vLLM's ``InputBatch`` does. Each row then samples: a new row its
first token (its prefill), a running row the longest prefix of its draft that the recorded
response continues with, plus one bonus token, written to ``token_ids_cpu`` as the runner does.
The draft step (``propose_for_runner``) follows. A request whose recorded response is done is
reported finished in the next step. Sampling params: EOS id from the trace (``eos_token_id``),
``max_tokens`` its ``max_new_tokens`` (else the model length: 2048, or what the trace's longest
request needs, ``trace_model_len``), groups from prompt hashes (no ``extra_args``).

Cost is the process's CPU time of ``update_states`` + ``propose_for_runner`` (the proposer's own
work, its drafter's included; the drafter proposes on one thread) over live requests x steps.
``--digest`` writes a hash of every step's drafts, to check that two versions of the proposer
propose the same.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rollout_spec.cli_args import DefaultsParser, check_output, int_arg  # noqa: E402
from rollout_spec.config import SpecConfig  # noqa: E402
from rollout_spec.integrations.vllm import engine_kwargs  # noqa: E402
from rollout_spec.integrations.vllm.proposer import RolloutSpecProposer  # noqa: E402
from rollout_spec.replay import Trace, accepted_length  # noqa: E402
from trace_files import add_trace_option, load_traces, replay_status  # noqa: E402

MAX_MODEL_LEN = 2048  # the replay's model length, unless a trace's requests need more


def trace_model_len(trace: Trace) -> int:
    """The model length a trace is replayed under: ``MAX_MODEL_LEN``, or one more than its longest
    prompt + response. A shorter one would stop such a request early in vLLM, while the replay
    goes on sampling the recorded response (without drafts, its tokens past the runner's table)."""
    longest = max((len(trace.prompts[g]) + len(r) for rows in trace.steps for g, r in rows), default=0)
    return max(MAX_MODEL_LEN, longest + 1)


class FakeInputBatch:
    """vLLM's persistent ``InputBatch``: per-row token table and counts, rows kept dense."""

    def __init__(self, max_num_reqs: int, max_model_len: int) -> None:
        self.req_ids: list[Optional[str]] = []  # None: a free row, until condensed
        self.req_id_to_index: dict[str, int] = {}
        self.token_ids_cpu = np.zeros((max_num_reqs, max_model_len), np.int32)
        self.num_tokens_no_spec = np.zeros(max_num_reqs, np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, np.int32)

    def remove_and_add(self, finished: list[str], new: list[tuple[str, list[int]]]) -> None:
        """vLLM's update: free the finished rows, fill the holes (lowest first) and then the end
        with new requests, then move the last rows into the holes left (``condense``)."""
        holes = sorted(self.req_id_to_index.pop(rid) for rid in finished)
        for row in holes:
            self.req_ids[row] = None
        for rid, prompt in new:
            row = holes.pop(0) if holes else len(self.req_ids)
            if row == len(self.req_ids):
                self.req_ids.append(rid)
            else:
                self.req_ids[row] = rid
            self._set_row(row, rid, prompt, len(prompt), len(prompt))
        for row in holes:
            while self.req_ids and self.req_ids[-1] is None:
                self.req_ids.pop()
            if row >= len(self.req_ids):
                break
            last = len(self.req_ids) - 1
            rid, n = self.req_ids.pop(), int(self.num_tokens_no_spec[last])
            self.req_ids[row] = rid
            self._set_row(row, rid, self.token_ids_cpu[last, :n].copy(), n,
                          int(self.num_prompt_tokens[last]))

    def _set_row(self, row: int, rid: str, tokens: Any, num_tokens: int, num_prompt: int) -> None:
        self.token_ids_cpu[row, :num_tokens] = tokens
        self.num_tokens_no_spec[row] = num_tokens
        self.num_prompt_tokens[row] = num_prompt
        self.req_id_to_index[rid] = row

    def commit(self, row: int, tokens: list[int]) -> None:
        """What the runner's bookkeeping does with a row's sampled tokens."""
        n = int(self.num_tokens_no_spec[row])
        self.token_ids_cpu[row, n:n + len(tokens)] = tokens
        self.num_tokens_no_spec[row] = n + len(tokens)


@dataclass
class StepCost:
    """One RL step's replay through the proposer."""

    step: int
    engine_steps: int = 0
    request_steps: int = 0  # live rows summed over engine steps
    tokens: int = 0  # tokens the rows sampled (accepted drafts + one each)
    seconds: float = 0.0  # CPU time of update_states + propose_for_runner
    digests: list[str] = field(default_factory=list)  # hash of each engine step's drafts

    @property
    def tpf(self) -> float:
        """Tokens per row per engine step (TPF)."""
        return self.tokens / max(self.request_steps, 1)

    @property
    def us_per_request_step(self) -> float:
        """CPU microseconds per live request per engine step."""
        return 1e6 * self.seconds / max(self.request_steps, 1)


def replay_step(prop: RolloutSpecProposer, trace: Trace, step: int, max_live: int) -> StepCost:
    """Replay one RL step's responses through ``prop`` lock-step (module docstring)."""
    rows = trace.steps[step]
    eos = trace.meta.get("eos_token_id")
    max_tokens = int((trace.meta.get("sampling") or {}).get("max_new_tokens", prop.max_model_len))
    batch = FakeInputBatch(max_live, prop.max_model_len)
    runner = SimpleNamespace(input_batch=batch, requests={})
    cost = StepCost(step)
    waiting = [(f"{step}-{j}", j) for j in range(len(rows)) if rows[j][1]][::-1]
    responses = {f"{step}-{j}": resp for j, (_, resp) in enumerate(rows)}  # by vLLM request id
    pos: dict[str, int] = {}  # response tokens committed, by live request
    drafts: dict[str, list[int]] = {}
    finished: list[str] = []
    while waiting or pos:
        new = []
        while waiting and len(pos) - len(finished) + len(new) < max_live:
            new.append(waiting.pop())
        cached = [rid for rid in batch.req_ids if rid not in finished]
        sched = SimpleNamespace(
            finished_req_ids=set(finished),
            scheduled_new_reqs=[SimpleNamespace(req_id=rid) for rid, _ in new],
            scheduled_cached_reqs=SimpleNamespace(req_ids=cached,
                                                  num_output_tokens=[pos[r] for r in cached]))
        t0 = time.process_time()
        prop.update_states(runner, sched)
        t1 = time.process_time()
        for rid in finished:
            del pos[rid], drafts[rid], runner.requests[rid]
        for rid, j in new:
            prompt = trace.prompts[rows[j][0]]
            runner.requests[rid] = SimpleNamespace(
                num_prompt_tokens=len(prompt),
                sampling_params=SimpleNamespace(
                    extra_args=None, eos_token_id=eos, ignore_eos=False, stop_token_ids=[],
                    max_tokens=max_tokens))
            pos[rid], drafts[rid] = 0, []
        batch.remove_and_add(finished, [(rid, trace.prompts[rows[j][0]]) for rid, j in new])
        sampled = []
        for row, rid in enumerate(batch.req_ids):
            resp, p = responses[rid], pos[rid]
            chain = drafts[rid]  # a tree whose node i is the child of node i - 1
            n = min(accepted_length(chain, range(-1, len(chain) - 1), resp[p:]) + 1, len(resp) - p)
            sampled.append(resp[p:p + n])
            batch.commit(row, sampled[-1])
            cost.tokens += n
            pos[rid] = p + n
        t2 = time.process_time()
        scheduler_output = SimpleNamespace(num_spec_tokens_to_schedule=prop.num_speculative_tokens)
        out = prop.propose_for_runner(runner, scheduler_output, sampled)
        t3 = time.process_time()
        cost.seconds += (t1 - t0) + (t3 - t2)
        cost.engine_steps += 1
        cost.request_steps += len(batch.req_ids)
        cost.digests.append(hashlib.blake2b(repr(out).encode(), digest_size=8).hexdigest())
        drafts.update(zip(batch.req_ids, out))
        finished = [rid for rid in batch.req_ids if pos[rid] >= len(responses[rid])]
    prop.update_states(runner, SimpleNamespace(
        finished_req_ids=set(finished), scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_output_tokens=[])))
    return cost


def trace_name(path: str) -> str:
    """A trace's name in the table and its key in the ``--digest`` file: its file name without
    ``.json`` and what follows."""
    return Path(path).name.split(".json")[0]


def check_digest_names(parser: argparse.ArgumentParser, paths: list[str]) -> None:
    """Refuse traces that share a name: the ``--digest`` file keys each trace's entries by it, so
    one trace's entries would silently replace the other's."""
    first: dict[str, str] = {}
    for path in paths:
        other = first.setdefault(trace_name(path), path)
        if other != path:
            parser.error(f"--digest: traces {other} and {path} are both named {trace_name(path)!r}, "
                         f"the key of their entries (rename one)")


def make_proposer(spec: SpecConfig, k: int, max_model_len: int = MAX_MODEL_LEN) -> RolloutSpecProposer:
    """A proposer over a fresh drafter, built from the vLLM config ``engine_kwargs`` gives."""
    config = SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=k),
        model_config=SimpleNamespace(max_model_len=max_model_len),
        additional_config=engine_kwargs(spec, k)["additional_config"])
    return RolloutSpecProposer(config)


def main(argv: Optional[list[str]] = None) -> None:
    """Parse the arguments, replay every trace --repeat times, print each step's median cost."""
    parser = DefaultsParser(description=__doc__.split("\n\n")[0])
    add_trace_option(parser)
    parser.add_argument("--max-live", type=int_arg("--max-live", 1, 1 << 16), default=512,
                        help="rows of vLLM's batch")
    parser.add_argument("--k", type=int_arg("--k", 1, 64), default=8, help="num_speculative_tokens")
    parser.add_argument("--tree", action="store_true",
                        help="SpecConfig.tree=True (default: chains, as docs/vllm.md advises)")
    parser.add_argument("--repeat", type=int_arg("--repeat", 1, 100), default=1,
                        help="replays per trace (median cost shown)")
    parser.add_argument("--digest", type=Path, help="write every step's draft hashes to this JSON file")
    args = parser.parse_args(argv)
    check_output(parser, "--digest", args.digest)  # refused now, not after every replay
    spec = SpecConfig(num_draft_tokens=args.k, tree=args.tree, propose_threads=1)
    traces = load_traces(parser, args.trace)
    if args.digest is not None:
        check_digest_names(parser, [path for path, _ in traces])
    digests: dict[str, list[list[str]]] = {}
    print("| trace | step | engine steps | TPF | us/req/step (runs) |\n|---|---|---|---|---|")
    for path, trace in traces:
        name = trace_name(path)
        runs: list[list[StepCost]] = []
        with replay_status(f"{name}, {args.repeat} replays" if args.repeat > 1 else name):
            for _ in range(args.repeat):
                prop = make_proposer(spec, args.k, trace_model_len(trace))
                costs = []
                for step in range(len(trace.steps)):
                    costs.append(replay_step(prop, trace, step, args.max_live))
                    prop.end_step()
                runs.append(costs)
        digests[name] = [c.digests for c in runs[0]]
        for s in range(len(trace.steps)):
            us = [run[s].us_per_request_step for run in runs]
            if any(run[s].digests != runs[0][s].digests for run in runs):
                raise SystemExit(f"{name} step {s}: drafts differ between replays")
            print(f"| {name} | {s} | {runs[0][s].engine_steps} | {runs[0][s].tpf:.3f} | "
                  f"{statistics.median(us):.2f} ({' '.join(f'{u:.2f}' for u in us)}) |", flush=True)
    if args.digest is not None:
        args.digest.write_text(json.dumps(digests))


if __name__ == "__main__":
    main()

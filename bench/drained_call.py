"""One synchronous batch per call, replayed from a trace: the budget's two rules on a modelled GPU.

Each call decodes ``--batch`` samples of a trace's RL step (in trace order, so whole groups) at
once, with nothing waiting for a slot: ``rollout-spec bench`` with its default ``--max-batch``,
or ``engine_bench.py --queue 1``. Such a call lasts as long as its slowest sample. Every
iteration the engine's own budget (``budget_from_cost``: grid, learned host residual, guard,
probes) picks a draft size for all live requests, under one of two rules:

* **throughput**: tokens per second, the rule for a queued workload (the engine's only rule
  before session 70);
* **drained**: the call's end (``engine/call_end.py``), which the engine uses once nothing waits.

Our drafter proposes for every live request (``--draft-tokens`` nodes); a tree's first k nodes
are its proposal at size k, walked along the recorded response as ``drafter_bench.py`` does. The
budget is fed as the engine feeds it: per-request outcomes of drafting steps, shadow rounds of
16 requests every 8 steps, and each step's modelled time. Step times are modelled, not measured:
a grid fitted to session 69-70's H200 figures for SmolLM2-135M (``--cost-grid`` takes an engine
cost cache file instead) plus host time, more on drafting steps. So the figures compare the
rules; docs/gpu.md has the GPU's own.

    python bench/drained_call.py                      # the shared traces, every RL step
    python bench/drained_call.py --trace T.json.gz --batch 64 --steps 1
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rollout_spec.cli_args import DefaultsParser, int_arg  # noqa: E402
from rollout_spec.config import SpecConfig  # noqa: E402
from rollout_spec.drafter import NgramDrafter, takes_noise_keys  # noqa: E402
from rollout_spec.engine.budget import CostModel, DraftBudget, budget_from_cost, draft_sizes  # noqa: E402
from rollout_spec.replay import Trace, accepted_path, as_trees  # noqa: E402
from trace_files import add_trace_option, load_traces, replay_status  # noqa: E402

RULES = ("throughput", "drained")
GRID_BATCHES = (1, 8, 32, 64, 128, 256)
HOST_PLAIN_S = 0.3e-3  # a plain step's host time beyond the forward (H200, B=128: 4.08 - 3.77 ms)
HOST_DRAFT_S = 0.6e-3  # a drafting step's: proposal, tree inputs, verification, commit ...
HOST_PER_NODE_S = 0.7e-6  # ... and per draft node (B=128, T=0.6, mean W 7.9: 1.2 ms in all)
SHADOW_EVERY, SHADOW_REQUESTS = 8, 16  # the engine's shadow rounds (shadow_acceptance.py)


def modelled_grid(max_draft: int) -> CostModel:
    """Forward seconds T(B, W): 3.2 ms + 4.5 us per request for a decode, each extra column
    adding 2% + 0.02% per request (H200: 3.21 ms at B=8, 3.75 at B=128; W=8 at B=128 taxed 1.32)."""
    widths = (1,) + tuple(k + 1 for k in draft_sizes(max_draft))
    return CostModel(GRID_BATCHES, widths, tuple(
        tuple((3.2e-3 + 4.5e-6 * b) * (1 + (w - 1) * (0.02 + 2e-4 * b)) for w in widths)
        for b in GRID_BATCHES))


def step_seconds(cost: CostModel, batch: int, width: int, nodes: int) -> float:
    """A step's modelled wall time: the grid's forward plus the host's part."""
    host = HOST_PLAIN_S if nodes == 0 else HOST_DRAFT_S + HOST_PER_NODE_S * nodes
    return cost.step_time(batch, width) + host


@dataclass
class CallFigures:
    """Modelled seconds, request-iterations and tokens of the calls of one RL step under one rule."""

    seconds: float = 0.0
    forwards: int = 0  # one per live request per iteration
    tokens: int = 0

    @property
    def tpf(self) -> float:
        """Tokens per target forward."""
        return self.tokens / max(self.forwards, 1)


def plain_seconds(cost: CostModel, lengths: list[int]) -> float:
    """Plain decoding of one call: a step per token of its longest response, over the live ones."""
    lengths_arr = np.asarray(lengths)
    return sum(step_seconds(cost, int((lengths_arr > t).sum()), 1, 0) for t in range(max(lengths, default=0)))


def run_call(drafter: NgramDrafter, budget: DraftBudget, rule: str, cost: CostModel, max_draft: int,
             ids: list[int], responses: dict[int, list[int]], out: CallFigures) -> None:
    """Decode one call lock-step under ``rule``; its figures are added to ``out``."""
    sizes = np.arange(max_draft + 1)
    done_len = {r: 0 for r in ids}
    empty = [r for r in ids if not responses[r]]
    if empty:  # nothing to decode (as replay.replay_step): finished at once, no forward
        drafter.finish_batch(empty)
    live, cursor, step = [r for r in ids if responses[r]], 0, 0
    # The engine reports the length cap's room; a recorded response ends where it ends, and the
    # longest response of the call stands for the cap every request could still reach.
    cap = max((len(responses[r]) for r in ids), default=0)
    while live:
        room = np.array([len(responses[r]) - done_len[r] for r in live], np.int64)
        # A request's first forward stands for its prefill, which draws the first token without a
        # draft (as in the engine and replay.replay_step): nothing is proposed or offered there.
        drafting = np.array([done_len[r] > 0 for r in live])
        budget.set_running(np.array(live), np.array([cap - done_len[r] for r in live]), rule == "drained")
        k = min(int(budget(len(live))), max_draft)
        trees = as_trees(drafter.propose(live, [max_draft if d else 0 for d in drafting.tolist()]), len(live))
        kept = np.array([np.searchsorted(accepted_path(t, p, responses[r][done_len[r]:]), sizes)
                         for r, (t, p) in zip(live, trees)])
        offered = np.where(drafting, np.minimum(k, room - 1), 0).clip(0)
        got = kept[np.arange(len(live)), offered]
        emitted = np.minimum(got + 1, room)
        drafted = [min(len(t), o) for (t, _), o in zip(trees, offered.tolist())]  # nodes per request
        nodes, width = sum(drafted), 1 + max(drafted, default=0)
        seconds = step_seconds(cost, len(live), width, nodes)
        if offered.sum():
            budget.observe(offered, got)
            budget.observe_requests(np.array(live), offered, got)
        if step % SHADOW_EVERY == 0 and drafting.any():  # a shadow round: every size, on a few
            pool = np.flatnonzero(drafting)  # requests past their prefill (it has no proposal)
            rows = pool[(cursor + np.arange(min(SHADOW_REQUESTS, len(pool)))) % len(pool)]
            cursor = (cursor + len(rows)) % len(pool)
            budget.observe_plain(kept[rows])
        budget.record_step(len(live), int(offered.sum()), nodes, width, seconds, tokens=int(emitted.sum()))
        out.seconds += seconds
        out.forwards += len(live)
        out.tokens += int(emitted.sum())
        drafter.extend_batch(live, [responses[r][done_len[r]:done_len[r] + n] for r, n in zip(live, emitted.tolist())])
        for r, n in zip(live, emitted.tolist()):
            done_len[r] += n
        finished = [r for r in live if done_len[r] >= len(responses[r])]
        if finished:
            drafter.finish_batch(finished)
            live = [r for r in live if done_len[r] < len(responses[r])]
        step += 1


def replay_rule(trace: Trace, rule: str, batch: int, steps: int, max_draft: int,
                cost: CostModel) -> list[CallFigures]:
    """Every call of the first ``steps`` RL steps under ``rule``, one drafter and budget throughout."""
    drafter = NgramDrafter(SpecConfig(num_draft_tokens=max_draft, propose_threads=1))
    budget = budget_from_cost(cost, batch, max_draft)
    figures, next_id = [], 0
    for s in range(steps):
        rows = trace.steps[s]
        keys = trace.noise_keys(s) if takes_noise_keys(drafter) else None
        out = CallFigures()
        for lo in range(0, len(rows), batch):
            part = range(lo, min(lo + batch, len(rows)))
            ids = [next_id + j for j in part]
            drafter.start_batch(ids, [trace.prompts[rows[j][0]] for j in part], [rows[j][0] for j in part])
            if keys is not None:
                drafter.set_noise_keys(ids, [keys[0][j] for j in part], [keys[1]] * len(ids), keys[2])
            run_call(drafter, budget, rule, cost, max_draft, ids,
                     {next_id + j: rows[j][1] for j in part}, out)
        figures.append(out)
        next_id += len(rows)
        drafter.end_step()
    return figures


def main(argv: list[str] | None = None) -> None:
    """Print one table row per trace and RL step."""
    ap = DefaultsParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_trace_option(ap)
    ap.add_argument("--batch", type=int_arg("--batch", 1, 256), default=128,
                    help="samples per call, all decoded at once (default: %(default)s, 16 prompts x n=8)")
    ap.add_argument("--steps", type=int_arg("--steps", 1), default=None,
                    help="RL steps replayed; at most the trace's step count (default: all)")
    ap.add_argument("--draft-tokens", type=int_arg("--draft-tokens", 1, 64), default=8,
                    help="most draft nodes per request; the budget picks a power of two below it, "
                         "or it")
    ap.add_argument("--cost-grid", type=Path, default=None,
                    help="an engine cost cache file (cost_*.json) to use instead of the modelled grid")
    args = ap.parse_args(argv)
    traces = load_traces(ap, args.trace, args.steps)
    cost = modelled_grid(args.draft_tokens)
    if args.cost_grid is not None:
        try:
            cost = CostModel.from_json(args.cost_grid.read_text())
        except (OSError, ValueError) as exc:
            ap.error(f"--cost-grid {args.cost_grid}: {exc}")
    print(f"one call = {args.batch} samples decoded at once; budget up to {args.draft_tokens} nodes; "
          f"modelled seconds (see the docstring)")
    print("| trace | RL step | plain s | " + " | ".join(f"{r}: speedup (TPF)" for r in RULES)
          + " |\n|---|---|---|" + "---|" * len(RULES))
    for path, trace in traces:
        steps = args.steps or len(trace.steps)
        with replay_status(Path(path).name):
            runs = {rule: replay_rule(trace, rule, args.batch, steps, args.draft_tokens, cost) for rule in RULES}
        for s in range(steps):
            rows = trace.steps[s]
            plain = sum(plain_seconds(cost, [len(r) for _, r in rows[lo:lo + args.batch]])
                        for lo in range(0, len(rows), args.batch))
            cells = [f"{plain / runs[r][s].seconds:.3f}x ({runs[r][s].tpf:.2f})" if runs[r][s].seconds
                     else "- (nothing decoded)" for r in RULES]
            print(f"| {Path(path).name} | {s} | {plain:.2f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()

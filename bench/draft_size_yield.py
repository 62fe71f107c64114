"""Tokens per step at each draft size k, three ways, on a rollout trace (why E(k) is kept per size).

Replays a trace lock-step with our drafter (as ``drafter_bench.py`` does) and prints E(k), the
tokens one verify step yields per request, for k in the engine budget's candidate sizes:

* **proposed at k**: a separate replay proposing k-node trees (the truth);
* **prefix of 8-node trees**: one replay proposing 8-node trees, each walked along the trace with
  only its first k nodes -- what the engine's shadow proposals measure;
* **per-depth model**: acceptance rates per depth learned from those 8-node trees, E(k) = 1 +
  sum of their cumulative products -- the budget's model before session 7.

    python bench/draft_size_yield.py                        # the shared traces, RL steps 0-1
    python bench/draft_size_yield.py --trace T.json.gz --steps 3 --max-live 512
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rollout_spec.cli_args import DefaultsParser, int_arg  # noqa: E402
from rollout_spec.config import SpecConfig  # noqa: E402
from rollout_spec.drafter import NgramDrafter  # noqa: E402
from rollout_spec.replay import Trace, accepted_path, replay  # noqa: E402
from trace_files import add_trace_option, load_traces, replay_status  # noqa: E402

SIZES = (1, 2, 4, 8)


def replay_sizes(trace: Trace, budget: int, steps: int, max_live: int) -> tuple[np.ndarray, np.ndarray]:
    """Replay with ``budget``-node trees; per proposal, the nodes kept from its first k nodes
    for k = 0..budget ([proposals, budget + 1]), and per depth d the (reached, accepted) counts."""
    kept, depth = [], np.zeros((budget + 1, 2), np.int64)
    sizes = np.arange(budget + 1)

    def record(tree: tuple[list[int], list[int]], continuation: list[int]) -> None:
        path = accepted_path(tree[0], tree[1], continuation)
        kept.append(np.searchsorted(path, sizes))
        if tree[0]:
            depth[1 : min(len(path) + 1, budget) + 1, 0] += 1
            depth[1 : len(path) + 1, 1] += 1

    replay(NgramDrafter(SpecConfig(num_draft_tokens=budget)), trace, budget, max_live,
           range(min(steps, len(trace.steps))), on_tree=record)
    return np.array(kept), depth


def main(argv: list[str] | None = None) -> None:
    """Print the table for each trace."""
    ap = DefaultsParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_trace_option(ap)
    ap.add_argument("--steps", type=int_arg("--steps", 1), default=None,
                    help="RL steps replayed; at most the trace's step count (default: the first 2, or 1 "
                         "on a one-step trace)")
    ap.add_argument("--max-live", type=int_arg("--max-live", 1, 1 << 20), default=256, help="concurrent requests")
    args = ap.parse_args(argv)
    traces = load_traces(ap, args.trace, args.steps)
    print("| trace | E(k) | " + " | ".join(f"k={k}" for k in SIZES) + " |\n|---|---|" + "---|" * len(SIZES))
    for path, trace in traces:
        steps = args.steps or min(2, len(trace.steps))
        with replay_status(Path(path).name):
            kept, depth = replay_sizes(trace, max(SIZES), steps, args.max_live)
            rates = depth[1:, 1] / np.maximum(depth[1:, 0], 1)
            rows = {
                "proposed at k": [1 + replay_sizes(trace, k, steps, args.max_live)[0][:, k].mean() for k in SIZES],
                "prefix of 8-node trees": [1 + kept[:, k].mean() for k in SIZES],
                "per-depth model": [1 + np.cumprod(rates[:k]).sum() for k in SIZES],
            }
        for name, values in rows.items():
            print(f"| {Path(path).name} | {name} | " + " | ".join(f"{v:.2f}" for v in values) + " |", flush=True)


if __name__ == "__main__":
    main()

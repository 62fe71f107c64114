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
import glob
from pathlib import Path

import numpy as np

from rollout_spec.config import SpecConfig
from rollout_spec.drafter import NgramDrafter
from rollout_spec.replay import Trace, accepted_path, as_trees, load_trace

SHARED = str(Path(__file__).resolve().parents[2] / "shared" / "traces" / "*.json.gz")
SIZES = (1, 2, 4, 8)


def replay_sizes(trace: Trace, budget: int, steps: int, max_live: int) -> tuple[np.ndarray, np.ndarray]:
    """Replay with ``budget``-node trees; per proposal, the nodes kept from its first k nodes
    for k = 0..budget ([proposals, budget + 1]), and per depth d the (reached, accepted) counts."""
    drafter = NgramDrafter(SpecConfig(num_draft_tokens=budget))
    kept, depth = [], np.zeros((budget + 1, 2), np.int64)
    sizes, first_id = np.arange(budget + 1), 0
    for step in range(min(steps, len(trace.steps))):
        rows = trace.steps[step]
        waiting, live = list(range(len(rows)))[::-1], {}
        while waiting or live:
            admit = []
            while waiting and len(live) + len(admit) < max_live:
                admit.append(waiting.pop())
            if admit:
                drafter.start_batch([first_id + j for j in admit], [trace.prompts[rows[j][0]] for j in admit],
                                    [rows[j][0] for j in admit])
                live.update((first_id + j, 0) for j in admit)
            ids = list(live)
            emitted, done = [], []
            for rid, (tok, par) in zip(ids, as_trees(drafter.propose(ids, [budget] * len(ids)), len(ids))):
                resp, pos = rows[rid - first_id][1], live[rid]
                path = accepted_path(tok, par, resp[pos:])
                kept.append(np.searchsorted(path, sizes))
                if tok:
                    reached = np.arange(1, min(len(path) + 1, budget) + 1)
                    depth[reached, 0] += 1
                    depth[1 : len(path) + 1, 1] += 1
                n = min(len(path) + 1, len(resp) - pos)
                emitted.append(resp[pos : pos + n])
                live[rid] = pos + n
                if pos + n >= len(resp):
                    done.append(rid)
            drafter.extend_batch(ids, emitted)
            if done:
                drafter.finish_batch(done)
                for rid in done:
                    del live[rid]
        first_id += len(rows)
        drafter.end_step()
    return np.array(kept), depth


def main(argv: list[str] | None = None) -> None:
    """Print the table for each trace."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", action="append", help="trace file (default: the shared traces)")
    ap.add_argument("--steps", type=int, default=2, help="RL steps replayed (default 2)")
    ap.add_argument("--max-live", type=int, default=256, help="concurrent requests (default 256)")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.max_live < 1:
        ap.error("--steps and --max-live must be >= 1")
    paths = args.trace or sorted(glob.glob(SHARED))
    if not paths:
        ap.error(f"no trace given and none found at {SHARED}")
    missing = [p for p in paths if not Path(p).is_file()]
    if missing:
        ap.error(f"--trace: no such file: {', '.join(missing)}")
    print("| trace | E(k) | " + " | ".join(f"k={k}" for k in SIZES) + " |\n|---|---|" + "---|" * len(SIZES))
    for path in paths:
        trace = load_trace(path)
        kept, depth = replay_sizes(trace, max(SIZES), args.steps, args.max_live)
        rates = depth[1:, 1] / np.maximum(depth[1:, 0], 1)
        rows = {
            "proposed at k": [1 + replay_sizes(trace, k, args.steps, args.max_live)[0][:, k].mean() for k in SIZES],
            "prefix of 8-node trees": [1 + kept[:, k].mean() for k in SIZES],
            "per-depth model": [1 + np.cumprod(rates[:k]).sum() for k in SIZES],
        }
        for name, values in rows.items():
            print(f"| {Path(path).name} | {name} | " + " | ".join(f"{v:.2f}" for v in values) + " |", flush=True)


if __name__ == "__main__":
    main()

"""Host time of the batch-aware budget's per-step bookkeeping, in microseconds per step.

Every decode step the engine asks the budget for the next size (``DraftBudget.__call__``) and
reports the step (``record_step``: the learned residual and the throughput guard). At B >= 128
with speculation off this is part of what the plain path pays over the no-spec engine, so it
should stay a few microseconds. Runs on a synthetic cost grid, no GPU needed.

    python bench/budget_overhead.py --steps 20000 --batch-sizes 8,128,256
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_spec.cli_args import DefaultsParser, int_arg, numbers_arg  # noqa: E402
from rollout_spec.engine.budget import CostModel, DraftBudget, budget_from_cost, draft_sizes  # noqa: E402

MAX_DRAFT = 32  # the engine bench's default draft budget
MAX_BATCH = 1 << 20  # the largest max_batch budget_from_cost takes


def make_budget(max_batch: int) -> DraftBudget:
    """The engine's own budget (``budget_from_cost``) on a grid of 3 ms steps growing with B and W."""
    batches = (1, 8, 32, 64, 128, max_batch)
    widths = (1,) + tuple(k + 1 for k in draft_sizes(MAX_DRAFT))
    grid = tuple(tuple(3e-3 * (1 + 1e-3 * b) * (1 + 1e-2 * w) for w in widths) for b in batches)
    return budget_from_cost(CostModel(batches, widths, grid), max_batch, MAX_DRAFT)


def per_step_us(fn: Callable[[], object], steps: int) -> float:
    """Mean wall microseconds of ``fn()`` over ``steps`` calls."""
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    return 1e6 * (time.perf_counter() - t0) / steps


def main(argv: list[str] | None = None) -> None:
    """CLI: one row per batch size."""
    ap = DefaultsParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int_arg("--steps", 1, 10**9), default=20000)
    ap.add_argument("--batch-sizes", type=numbers_arg("--batch-sizes", int, 1, MAX_BATCH), default="8,128,256")
    args = ap.parse_args(argv)
    print("| B | record_step, plain us | record_step, drafting us | decision us |\n|---|---|---|---|")
    for b in args.batch_sizes:
        budget = make_budget(max(256, b))
        plain = per_step_us(lambda: budget.record_step(b, 0, 0, 1, 4.7e-3, tokens=b), args.steps)
        drafting = per_step_us(lambda: budget.record_step(b, 4 * b, 3 * b, 5, 6.0e-3, tokens=2 * b), args.steps)
        decision = per_step_us(lambda: budget(b), args.steps)
        print(f"| {b} | {plain:.1f} | {drafting:.1f} | {decision:.1f} |")


if __name__ == "__main__":
    main()

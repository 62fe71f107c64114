"""What a speculative engine costs while it never drafts: ms per decode step, same run.

Three engines on one SmolLM2-135M-shaped model with random weights (no checkpoint needed): the
plain engine (no drafter), the speculative engine with a budget of 0 (its drafter is fed, nothing
is proposed), and the same with a budget that also takes acceptance from plain steps (shadow
proposals every 8 plain steps, ``engine/shadow_acceptance.py``). Each row is several interleaved
rounds of ``generate`` (the first is a warm-up); it prints the median ms per decode step with
the range, and the median ``generate`` seconds.

    python bench/idle_overhead.py --device cuda
    python bench/idle_overhead.py --device cpu --slots 8 --batch-sizes 1 --new-tokens 24
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_bench import SMOLLM2_135M, random_model  # noqa: E402
from rollout_spec import SamplingParams, SpecConfig  # noqa: E402
from rollout_spec.cli_args import (DefaultsParser, add_device_option, check_device, int_arg,  # noqa: E402
                                   numbers_arg)
from rollout_spec.engine import RolloutEngine  # noqa: E402

PROMPT_LEN = 128  # random ids per prompt
# each engine's max_model_len is PROMPT_LEN + --new-tokens + 16, at most the model's positions
MAX_NEW_TOKENS = SMOLLM2_135M["max_position_embeddings"] - PROMPT_LEN - 16


class ShadowOnlyBudget:
    """Never drafts, but has ``observe_plain``, so the engine runs its shadow proposals."""

    def __init__(self) -> None:
        self.rows = 0

    def __call__(self, batch_size: int) -> int:
        return 0

    def observe_plain(self, accepted: np.ndarray) -> None:
        """Count the plain rows the engine reports (the engine calls this only if it exists)."""
        self.rows += len(accepted)


def main(argv: list[str] | None = None) -> None:
    """Build the three engines and print the table."""
    ap = DefaultsParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device_option(ap)
    ap.add_argument("--slots", type=int_arg("--slots", 1, 1 << 20), default=256,
                    help="KV slots per engine")
    ap.add_argument("--batch-sizes", type=numbers_arg("--batch-sizes", int, 1, 1 << 20), default="1,64,256",
                    help="comma-separated samples decoded at once, each at most --slots")
    ap.add_argument("--new-tokens", type=int_arg("--new-tokens", 2, MAX_NEW_TOKENS), default=256,
                    help="tokens per sample (the prefill draws the first; the rest are decode steps)")
    ap.add_argument("--rounds", type=int_arg("--rounds", 2, 1000), default=4,
                    help="rounds per row, the first a warm-up")
    args = ap.parse_args(argv)
    args.device = check_device(ap, args.device)
    if max(args.batch_sizes) > args.slots:
        ap.error(f"every --batch-sizes value must be in [1, --slots={args.slots}], got {max(args.batch_sizes)}")
    dev = torch.device(args.device)
    model, _ = random_model(dev, torch.bfloat16 if dev.type == "cuda" else torch.float32)
    kw = dict(num_slots=args.slots, max_model_len=PROMPT_LEN + args.new_tokens + 16)
    spec = SpecConfig(num_draft_tokens=8)
    engines = {
        "plain": RolloutEngine(model, None, None, **kw),
        "spec, budget 0": RolloutEngine(model, None, spec, draft_budget=lambda b: 0, **kw),
        "spec, budget 0 + shadow": RolloutEngine(model, None, spec, draft_budget=ShadowOnlyBudget(), **kw),
    }
    rng = np.random.default_rng(0)
    print("| B | engine | ms per decode step, median (range) | generate s, median |\n|---|---|---|---|")
    for b in args.batch_sizes:
        n = 2 if b == 1 else 8  # GRPO's n; at B=1 two samples run one after the other
        prompts = [rng.integers(0, 49152, PROMPT_LEN).tolist() for _ in range(max(1, b // n))]
        params = SamplingParams(n=n, temperature=1.0, max_new_tokens=args.new_tokens, seed=1)
        got: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in engines}
        for r in range(args.rounds):
            for name, eng in engines.items():
                before = dict(eng.phase_seconds)
                t0 = time.perf_counter()
                eng.generate(prompts, params, max_running=b)
                wall = time.perf_counter() - t0
                d = {k: eng.phase_seconds[k] - before[k] for k in before}
                if r:
                    got[name][0].append(1e3 * (d["propose"] + d["forward_verify"] + d["commit"]) / d["steps"])
                    got[name][1].append(wall)
        for name, (ms, wall) in got.items():
            print(f"| {b} | {name} | {np.median(ms):.3f} ({min(ms):.3f}-{max(ms):.3f}) | "
                  f"{np.median(wall):.3f} |", flush=True)
    print(f"shadow measurements taken: {engines['spec, budget 0 + shadow'].draft_budget.rows} requests")


if __name__ == "__main__":
    main()

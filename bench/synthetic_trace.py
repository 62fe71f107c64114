"""Generate synthetic GRPO rollout traces in the shared trace format (see /work/shared/traces).

The structure mimics what makes real RL rollouts draftable: prompts share a chat template; each
prompt has a latent "solution" that its n samples follow with random departures (so siblings
share long spans but diverge), responses quote the prompt, common phrases recur across prompts,
lengths vary, and each later RL step re-samples the prompts from a slowly drifting solution.

    python bench/synthetic_trace.py out.json.gz --prompts 64 --n 8 --steps 3 --seed 0
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rollout_spec.cli_args import DefaultsParser, check_output, int_arg
from rollout_spec.config import check_fields
from rollout_spec.replay import Trace, save_trace
from rollout_spec.token_ids import MAX_TOKEN_ID


@dataclass(frozen=True)
class SyntheticSpec:
    """Knobs of the generator; defaults give traces of roughly the real ones' size and TPF."""

    prompts: int = 64
    n: int = 8
    steps: int = 3
    vocab: int = 32_000
    phrases: int = 400  # shared phrase bank (template text, common reasoning steps)
    follow: float = 0.7  # chance a sample keeps following its prompt's solution at a span break
    drift: float = 0.2  # fraction of solution spans rewritten between RL steps
    max_tokens: int = 384
    eos: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        """Check every field (an error names it and its range), so that a spec either builds a
        trace that ``load_trace`` reads back or fails here, not deep inside numpy; the counts are
        the command line's ranges, tokens are drawn from [3, vocab), and numbers are stored as
        plain int/float (the trace's metadata is JSON)."""
        check_fields(self, ints={"prompts": (1, 100_000), "n": (1, 1024), "steps": (1, 1000),
                                 "vocab": (4, MAX_TOKEN_ID + 1), "phrases": (1, 1 << 20),
                                 "max_tokens": (2, 1 << 20), "eos": (0, MAX_TOKEN_ID), "seed": (0, None)},
                     floats={"follow": (0.0, 1.0), "drift": (0.0, 1.0)})


def _span(rng: np.random.Generator, bank: list[np.ndarray], vocab: int) -> np.ndarray:
    """A common phrase (60%) or fresh random tokens."""
    if rng.random() < 0.6:
        return bank[rng.integers(len(bank))]
    return rng.integers(3, vocab, rng.integers(3, 12), dtype=np.int64)


def _solution(rng, bank, vocab, prompt: np.ndarray, length: int) -> list[np.ndarray]:
    """A prompt's latent solution: spans of phrases, fresh text and quotes from the prompt."""
    spans, total = [], 0
    while total < length:
        if rng.random() < 0.15 and len(prompt) > 8:
            a = rng.integers(0, len(prompt) - 6)
            span = prompt[a:a + rng.integers(3, 7)]
        else:
            span = _span(rng, bank, vocab)
        spans.append(span)
        total += len(span)
    return spans


def _sample(rng, bank, vocab, solution: list[np.ndarray], spec: SyntheticSpec) -> list[int]:
    """One response: walk the solution, sometimes wandering off for a span or skipping ahead."""
    out: list[int] = []
    i = 0
    limit = int(spec.max_tokens * rng.uniform(0.5, 1.0))
    while i < len(solution) and len(out) < limit:
        if rng.random() < spec.follow:
            out.extend(solution[i].tolist())
            i += 1
        else:
            out.extend(_span(rng, bank, vocab).tolist())
            i += int(rng.integers(0, 2))
    out = out[:spec.max_tokens - 1]
    return out + [spec.eos] if len(out) < spec.max_tokens - 1 or rng.random() < 0.5 else out


def make_synthetic_trace(spec: SyntheticSpec = SyntheticSpec()) -> Trace:
    """Build a Trace with ``spec.prompts`` groups, ``spec.n`` samples each, ``spec.steps`` steps."""
    rng = np.random.default_rng(spec.seed)
    bank = [rng.integers(3, spec.vocab, rng.integers(2, 10), dtype=np.int64) for _ in range(spec.phrases)]
    head, tail = rng.integers(3, spec.vocab, 20), rng.integers(3, spec.vocab, 15)
    prompts, solutions = {}, {}
    for g in range(spec.prompts):
        question = rng.integers(3, spec.vocab, rng.integers(30, 120))
        prompts[g] = np.concatenate([head, question, tail]).tolist()
        # about 100 tokens at least (fewer where max_tokens is smaller), up to max_tokens
        length = int(rng.integers(min(100, spec.max_tokens - 1), spec.max_tokens))
        solutions[g] = _solution(rng, bank, spec.vocab, question, length)
    steps = []
    for _ in range(spec.steps):
        rows = []
        for g in range(spec.prompts):
            for _ in range(spec.n):
                rows.append((g, _sample(rng, bank, spec.vocab, solutions[g], spec)))
            sol = solutions[g]  # the policy moves a little between steps
            for j in np.flatnonzero(rng.random(len(sol)) < spec.drift):
                sol[j] = _span(rng, bank, spec.vocab)
        steps.append(rows)
    meta = {"model": "synthetic", "sampling": {"generator": "bench/synthetic_trace.py", **spec.__dict__},
            "eos_token_id": spec.eos}
    return Trace(prompts=prompts, steps=steps, meta=meta)


def main(argv: list[str] | None = None) -> None:
    """CLI: write one synthetic trace."""
    ap = DefaultsParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="trace file to write (gzip JSON when it ends in .gz)")
    ap.add_argument("--prompts", type=int_arg("--prompts", 1, 100_000), default=64, help="groups per step")
    ap.add_argument("--n", type=int_arg("--n", 1, 1024), default=8, help="samples per prompt")
    ap.add_argument("--steps", type=int_arg("--steps", 1, 1000), default=3, help="RL steps")
    ap.add_argument("--seed", type=int_arg("--seed", 0), default=0)
    args = ap.parse_args(argv)
    check_output(ap, "out", args.out)
    trace = make_synthetic_trace(SyntheticSpec(prompts=args.prompts, n=args.n, steps=args.steps, seed=args.seed))
    save_trace(trace, args.out)
    print(f"wrote {args.out}: {len(trace.prompts)} prompts, {len(trace.steps)} steps, {trace.num_tokens} tokens")


if __name__ == "__main__":
    main()

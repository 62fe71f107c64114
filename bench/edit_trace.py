"""Generate a code-edit trace: each response copies its long prompt with a few spans edited.

This is the workload of prompt lookup (an assistant rewriting a file it was given), which the
GRPO traces hardly exercise: drafts come from the request's own prompt, far back, behind tokens
that recur every few positions. Token frequencies follow a Zipf law, so the last token of a
context is often a frequent one whose newest occurrences are all elsewhere. One sample per
prompt and one RL step: the group and global scopes have nothing to add.

    python bench/edit_trace.py edit.json.gz && \\
        python bench/drafter_bench.py --trace edit.json.gz --drafters ours,prompt-lookup
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
class EditSpec:
    """Knobs of the generator: prompt count and sizes, vocabulary, edit rate, seed."""

    prompts: int = 64
    file_tokens: int = 1500  # the file each prompt holds (after a short instruction)
    instruction_tokens: int = 40
    vocab: int = 2000
    zipf: float = 1.1  # token i has weight 1 / i**zipf
    edit_rate: float = 0.03  # chance per copied token that an edit starts there
    max_edit: int = 6  # an edit writes 1..max_edit new tokens and skips 0..max_edit of the file
    seed: int = 0

    def __post_init__(self) -> None:
        """Check every field (an error names it and its range) rather than fail deep inside
        numpy; the counts are the command line's ranges, tokens are drawn from [0, vocab), and
        numbers are stored as plain int/float (the trace's metadata is JSON)."""
        check_fields(self, ints={"prompts": (1, 100_000), "file_tokens": (1, 1 << 20),
                                 "instruction_tokens": (0, 1 << 20), "vocab": (1, MAX_TOKEN_ID + 1),
                                 "max_edit": (1, 1 << 20), "seed": (0, None)},
                     floats={"zipf": (0.0, 100.0), "edit_rate": (0.0, 1.0)})


def _edited_copy(rng: np.random.Generator, file: list[int], spec: EditSpec, p: np.ndarray) -> list[int]:
    """The file with random spans replaced by fresh tokens."""
    out, i = [], 0
    while i < len(file):
        if rng.random() < spec.edit_rate:
            out += rng.choice(spec.vocab, size=int(rng.integers(1, spec.max_edit + 1)), p=p).tolist()
            i += int(rng.integers(0, spec.max_edit + 1))
        else:
            out.append(file[i])
            i += 1
    return out


def make_edit_trace(spec: EditSpec = EditSpec()) -> Trace:
    """Build a one-step Trace of ``spec.prompts`` groups with one edited copy each."""
    rng = np.random.default_rng(spec.seed)
    p = 1.0 / np.arange(1, spec.vocab + 1) ** spec.zipf
    p /= p.sum()
    prompts, rows = {}, []
    for g in range(spec.prompts):
        file = rng.choice(spec.vocab, size=spec.file_tokens, p=p).tolist()
        prompts[g] = rng.choice(spec.vocab, size=spec.instruction_tokens, p=p).tolist() + file
        rows.append((g, _edited_copy(rng, file, spec, p)))
    meta = {"model": "synthetic-edit", "sampling": {"generator": "bench/edit_trace.py", **spec.__dict__}}
    return Trace(prompts=prompts, steps=[rows], meta=meta)


def main(argv: list[str] | None = None) -> None:
    """CLI: write one code-edit trace."""
    ap = DefaultsParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="trace file to write (gzip JSON when it ends in .gz)")
    ap.add_argument("--prompts", type=int_arg("--prompts", 1, 100_000), default=64)
    ap.add_argument("--file-tokens", type=int_arg("--file-tokens", 1, 1 << 20), default=1500,
                    help="tokens of the file each prompt holds")
    ap.add_argument("--seed", type=int_arg("--seed", 0), default=0)
    args = ap.parse_args(argv)
    check_output(ap, "out", args.out)
    trace = make_edit_trace(EditSpec(prompts=args.prompts, file_tokens=args.file_tokens, seed=args.seed))
    save_trace(trace, args.out)
    print(f"wrote {args.out}: {len(trace.prompts)} prompts, {trace.num_tokens} tokens")


if __name__ == "__main__":
    main()

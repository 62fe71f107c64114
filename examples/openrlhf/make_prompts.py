"""Write a GRPO prompt set for the OpenRLHF example: reasoning-gym tasks as JSONL lines
``{"prompt": ..., "label": ...}`` (OpenRLHF's ``--data.input_key prompt --data.label_key label``).

    python examples/openrlhf/make_prompts.py --out data/prompts.jsonl --size 512

Every option is checked before anything is written, and the file is written under a temporary
name and renamed at the end, so a failed run never leaves a truncated ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Optional, Sequence

import reasoning_gym
from reasoning_gym.factory import DATASETS

from rollout_spec.cli_args import DefaultsParser, check_distinct, check_output, int_arg
from rollout_spec.workloads import checked_gym_dataset

INSTRUCTION = "Solve the problem. End your reply with 'Answer: <number>'.\n\n"


def task_arg(text: str) -> str:
    """An argparse type: a task registered in reasoning-gym."""
    if text not in DATASETS:
        raise argparse.ArgumentTypeError(
            f"every --tasks value must be a reasoning-gym task (e.g. basic_arithmetic, chain_sum; "
            f"{len(DATASETS)} in all), got {text!r}")
    return text


def write_prompts(out: Path, tasks: list[str], size: int, seed: int) -> int:
    """Write ``size`` prompts per task to ``out`` (atomically); returns the number of lines written."""
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    count = 0
    try:
        with tmp.open("x") as fh:
            for task in tasks:
                for entry in reasoning_gym.create_dataset(task, size=size, seed=seed):
                    fh.write(json.dumps({"prompt": INSTRUCTION + entry["question"],
                                         "label": str(entry["answer"])}) + "\n")
                    count += 1
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return count


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = DefaultsParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("data/prompts.jsonl"))
    parser.add_argument("--tasks", type=task_arg, nargs="+", default=["basic_arithmetic", "chain_sum"])
    parser.add_argument("--size", type=int_arg("--size", 1, 1_000_000), default=256, help="prompts per task")
    parser.add_argument("--seed", type=int_arg("--seed", 0, 2**62), default=0)
    args = parser.parse_args(argv)
    check_distinct(parser, "--tasks", args.tasks)  # a task given twice wrote its prompts twice
    for task in args.tasks:  # a task that cannot make its prompts fails here, not mid-write
        try:
            checked_gym_dataset(task, args.size, args.seed)
        except ValueError as exc:
            parser.error(f"--tasks {task} with --seed {args.seed}: {exc}")
    try:  # after every other check: a refused run leaves no folder behind
        args.out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        parser.error(f"--out {args.out}: cannot create its folder ({exc.strerror})")
    check_output(parser, "--out", args.out)
    print(f"wrote {write_prompts(args.out, args.tasks, args.size, args.seed)} prompts to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

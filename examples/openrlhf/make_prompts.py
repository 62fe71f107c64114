"""Write a GRPO prompt set for the OpenRLHF example: reasoning-gym tasks as JSONL lines
``{"prompt": ..., "label": ...}`` (OpenRLHF's ``--data.input_key prompt --data.label_key label``).

    python examples/openrlhf/make_prompts.py --out data/prompts.jsonl --size 512
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import reasoning_gym

INSTRUCTION = "Solve the problem. End your reply with 'Answer: <number>'.\n\n"


def write_prompts(out: Path, tasks: list[str], size: int, seed: int) -> int:
    """Write ``size`` prompts per task to ``out``; returns the number of lines written."""
    out.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with out.open("w") as fh:
        for task in tasks:
            for entry in reasoning_gym.create_dataset(task, size=size, seed=seed):
                fh.write(json.dumps({"prompt": INSTRUCTION + entry["question"],
                                     "label": str(entry["answer"])}) + "\n")
                count += 1
    return count


def main() -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("data/prompts.jsonl"))
    parser.add_argument("--tasks", nargs="+", default=["basic_arithmetic", "chain_sum"])
    parser.add_argument("--size", type=int, default=256, help="prompts per task")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"wrote {write_prompts(args.out, args.tasks, args.size, args.seed)} prompts to {args.out}")


if __name__ == "__main__":
    main()

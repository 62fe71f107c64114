"""Write gsm8k-style GRPO data for verl from reasoning-gym's ``gsm_symbolic`` task, offline.

Rows follow verl's RL dataset schema (``data_source``, chat ``prompt``, ``reward_model``) with
``data_source="openai/gsm8k"``, so verl's built-in gsm8k scorer (final answer after ``####``)
is the reward. Usage: ``python examples/verl/make_gsm_data.py --out ~/data/gsm_symbolic``.
"""
from __future__ import annotations

import argparse
from pathlib import Path

INSTRUCTION = "Think step by step, then give the final answer after '####'."


def rows(split: str, size: int, seed: int) -> list[dict]:
    """``size`` verl rows of ``gsm_symbolic`` questions drawn with ``seed``."""
    import reasoning_gym

    data = reasoning_gym.create_dataset("gsm_symbolic", size=size, seed=seed)
    out = []
    for i, item in enumerate(data):
        out.append({
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"{item['question']} {INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(item["answer"])},
            "extra_info": {"split": split, "index": i},
        })
    return out


def main(argv: list[str] | None = None) -> None:
    """Write ``train.parquet`` and ``test.parquet`` under ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--train-size", type=int, default=2048)
    parser.add_argument("--test-size", type=int, default=256)
    args = parser.parse_args(argv)
    import pandas as pd

    args.out.mkdir(parents=True, exist_ok=True)
    for split, size, seed in (("train", args.train_size, 1), ("test", args.test_size, 2)):
        path = args.out / f"{split}.parquet"
        pd.DataFrame(rows(split, size, seed)).to_parquet(path)
        print(f"wrote {size} rows to {path}")


if __name__ == "__main__":
    main()

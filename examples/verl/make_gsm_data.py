"""Write gsm8k-style GRPO data for verl from reasoning-gym's ``gsm_symbolic`` task, offline.

Rows follow verl's RL dataset schema (``data_source``, chat ``prompt``, ``reward_model``) with
``data_source="openai/gsm8k"``, so verl's built-in gsm8k scorer (final answer after ``####``)
is the reward. Usage: ``python examples/verl/make_gsm_data.py --out ~/data/gsm_symbolic``.

Needs pandas and pyarrow (installed with verl: ``pip install "rollout-spec[verl]"``, or
``pip install pandas pyarrow``) and reasoning-gym (``rollout-spec[workloads]``). Both files are
written only once both datasets are built, under temporary names renamed at the end, so a
failed run leaves any earlier ``train.parquet``/``test.parquet`` as they were.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Optional, Sequence

from rollout_spec.cli_args import DefaultsParser, check_output, int_arg, path_arg

INSTRUCTION = "Think step by step, then give the final answer after '####'."
SEEDS = {"train": 1, "test": 2}
NEEDS = {"pandas": "rollout-spec[verl]", "pyarrow": "rollout-spec[verl]",
         "reasoning_gym": "rollout-spec[workloads]"}


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


def write_splits(out: Path, sizes: dict[str, int]) -> None:
    """Build every split's rows (seeded by ``SEEDS``), then write ``out/<split>.parquet`` atomically."""
    import pandas as pd

    frames = {split: pd.DataFrame(rows(split, size, SEEDS[split])) for split, size in sizes.items()}
    temps = {split: out / f".{split}.parquet.{os.getpid()}.tmp" for split in frames}
    try:
        for split, frame in frames.items():
            frame.to_parquet(temps[split])
        for split, tmp in temps.items():
            os.replace(tmp, out / f"{split}.parquet")
            print(f"wrote {sizes[split]} rows to {out / f'{split}.parquet'}")
    finally:
        for tmp in temps.values():
            tmp.unlink(missing_ok=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Write ``train.parquet`` and ``test.parquet`` under ``--out``; returns the exit status."""
    parser = DefaultsParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=path_arg, required=True, help="output directory")
    parser.add_argument("--train-size", type=int_arg("--train-size", 1, 10_000_000), default=2048)
    parser.add_argument("--test-size", type=int_arg("--test-size", 1, 10_000_000), default=256)
    args = parser.parse_args(argv)
    missing = [name for name in NEEDS if importlib.util.find_spec(name) is None]
    if missing:
        extras = " ".join(sorted({f"'{NEEDS[m]}'" for m in missing}))
        parser.error(f"writing the data needs {', '.join(missing)}: pip install {extras} "
                     f"(or pip install {' '.join(m.replace('_', '-') for m in missing)})")
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        parser.error(f"--out {args.out}: cannot create the folder ({exc.strerror})")
    check_output(parser, "--out", args.out / "train.parquet")
    write_splits(args.out, {"train": args.train_size, "test": args.test_size})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

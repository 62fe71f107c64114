"""A small synthetic GRPO trace file: the input of the bench scripts' smoke tests."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from rollout_spec.replay import save_trace  # noqa: E402
from synthetic_trace import SyntheticSpec, make_synthetic_trace  # noqa: E402


def small_trace(tmp_path: Path, seed: int = 5) -> Path:
    """Four prompts, four siblings each, two RL steps of up to 120 tokens, saved under ``tmp_path``."""
    path = tmp_path / "t.json.gz"
    save_trace(make_synthetic_trace(SyntheticSpec(prompts=4, n=4, steps=2, max_tokens=120, seed=seed)), path)
    return path

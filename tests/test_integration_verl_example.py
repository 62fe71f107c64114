"""examples/verl: the data it writes is scored by verl's own gsm8k scorer; its flag parses."""
from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

from rollout_spec.config import SpecConfig
from rollout_spec.integrations.verl.config import spec_from_rollout_config

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "verl"


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def verl_gsm8k_scorer():
    found = importlib.util.find_spec("verl")
    if found is None or not found.submodule_search_locations:
        pytest.skip("verl not installed (pip install --no-deps verl)")
    root = Path(list(found.submodule_search_locations)[0])
    return load(root / "utils" / "reward_score" / "gsm8k.py", "verl_gsm8k_scorer")


def test_rows_have_verls_schema_and_verl_scores_them():
    pytest.importorskip("reasoning_gym")
    rows = load(EXAMPLES / "make_gsm_data.py", "make_gsm_data").rows("train", 3, seed=1)
    scorer = verl_gsm8k_scorer()
    assert len(rows) == 3
    for row in rows:
        assert row["data_source"] == "openai/gsm8k" and row["prompt"][0]["role"] == "user"
        assert "####" in row["prompt"][0]["content"]
        truth = row["reward_model"]["ground_truth"]
        assert scorer.compute_score(f"so the total is\n#### {truth}", truth) == 1.0
        assert scorer.compute_score("#### 123456789", truth) == 0.0


def test_script_is_valid_bash_and_its_flag_parses():
    script = EXAMPLES / "run_grpo_smollm2.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert "+actor_rollout_ref.rollout.custom.speculative=rollout_spec" in text
    body = re.search(r"custom\.rollout_spec='\{(.*?)\}'", text).group(1)
    options = {k.strip(): float(v) if "." in v else int(v) for k, v in (p.split(":") for p in body.split(","))}
    cfg = {"name": "sglang", "custom": {"speculative": "rollout_spec", "rollout_spec": options}}
    assert spec_from_rollout_config(cfg) == SpecConfig(num_draft_tokens=8, max_depth=24, history_steps=4)

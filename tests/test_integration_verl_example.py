"""examples/verl: the data it writes is scored by verl's own gsm8k scorer; its launch composes
with verl's own config and turns rollout-spec on."""
from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from rollout_spec.config import SpecConfig
from rollout_spec.integrations.verl.config import spec_from_rollout_config
from verl_hydra import compose_verl  # tests/ is on sys.path

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


def script_overrides(text: str, **variables: str) -> list[str]:
    """The Hydra overrides the script passes to ``verl.trainer.main_ppo``, its ``$VARS`` replaced."""
    launch = re.search(r"python3 -m verl\.trainer\.main_ppo(.*?)\"\$@\"", text, re.S).group(1)
    for name, value in variables.items():
        launch = launch.replace(f"${name}", value)
    assert "$" not in launch, "a variable of the script is not given"
    return shlex.split(launch.replace("\\\n", " "))


@pytest.mark.parametrize("rollout", ["sglang", "vllm"])
def test_script_is_valid_bash_and_its_overrides_compose_with_verls_config(rollout: str):
    """Every override of the script is a key of verl's own trainer config (or a ``+`` addition),
    composed by Hydra as the launch composes it, and the rollout config turns rollout-spec on."""
    script = EXAMPLES / "run_grpo_smollm2.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    overrides = script_overrides(script.read_text(), DATA="/data", MODEL="model", ROLLOUT=rollout)
    config = compose_verl(overrides)
    assert (config.actor_rollout_ref.rollout.name, config.actor_rollout_ref.rollout.n) == (rollout, 8)
    spec = spec_from_rollout_config(config.actor_rollout_ref.rollout)
    assert spec == SpecConfig(num_draft_tokens=8, max_depth=24, history_steps=4)

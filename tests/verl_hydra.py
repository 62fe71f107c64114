"""verl's own trainer config, composed by Hydra from verl's yaml as ``python -m
verl.trainer.main_ppo`` composes it, for the tests that check the verl overrides the docs and the
example script show. verl itself is not imported (its runtime needs CUDA packages); only its
installed config files are read."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Sequence

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig

VERL_CONFIG = "ppo_trainer"
"""The config ``verl.trainer.main_ppo``'s ``@hydra.main`` composes."""


def verl_config_dir() -> Path:
    """The installed verl's ``trainer/config`` folder; the test is skipped without verl."""
    found = importlib.util.find_spec("verl")
    if found is None or not found.submodule_search_locations:
        pytest.skip("verl not installed (scripts/setup.sh test installs its files)")
    return Path(list(found.submodule_search_locations)[0]) / "trainer" / "config"


def compose_verl(overrides: Sequence[str]) -> DictConfig:
    """verl's trainer config with ``overrides`` applied.

    Raises:
        hydra.errors.HydraException: an override is malformed, or sets a key verl's config does
            not have without Hydra's ``+`` (``ConfigCompositionException``).
    """
    with initialize_config_dir(config_dir=str(verl_config_dir()), version_base=None):
        return compose(config_name=VERL_CONFIG, overrides=list(overrides))


def hydra_value(text: str) -> Any:
    """An override's value as Hydra reads it (``8``, ``null``, ``[]``, ``{k: v}``, ...)."""
    return OverridesParser.create().parse_override(f"key={text}").value()

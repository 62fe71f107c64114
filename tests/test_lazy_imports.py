"""Importing the packages stays cheap: torch, Ray and the engine load only when a name needs them."""
from __future__ import annotations

import subprocess
import sys

import pytest

import rollout_spec
import rollout_spec.distributed
import rollout_spec.engine
import rollout_spec.integrations.sglang


def test_importing_the_packages_loads_no_heavy_module_until_a_lazy_name_is_used() -> None:
    # A fresh interpreter: this one has long imported everything.
    script = """
import sys
import rollout_spec, rollout_spec.distributed
heavy = ("torch", "ray", "rollout_spec.engine", "rollout_spec.drafter")
assert not [m for m in heavy if m in sys.modules], [m for m in heavy if m in sys.modules]
rollout_spec.NgramDrafter
assert "rollout_spec.drafter" in sys.modules and "torch" not in sys.modules
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("package", [rollout_spec, rollout_spec.distributed, rollout_spec.engine,
                                     rollout_spec.integrations.sglang],
                         ids=lambda p: p.__name__)
def test_every_exported_name_resolves_and_an_unknown_one_is_an_attribute_error(package) -> None:
    assert all(getattr(package, name) is not None for name in package.__all__)
    with pytest.raises(AttributeError, match=f"module '{package.__name__}' has no attribute 'no_such_name'"):
        package.no_such_name

"""The verl launches and overrides the docs show compose with verl's own config and turn
rollout-spec on with valid options.

The docs are read as in test_docs_commands.py (doc_code.py). ``python -m verl.trainer.main_ppo``
lines: their Hydra overrides are applied by Hydra to the installed verl's trainer config, as the
launch would apply them (verl_hydra.py; verl itself is never imported), so every key must exist
in verl's config or carry Hydra's ``+`` (``custom`` is a field of verl's ``RolloutConfig`` but
not of its yaml); the composed ``actor_rollout_ref.rollout`` must pass ``spec_from_rollout_config``
(the replica's validator) with the flag on. An inline span that is one override under ``custom``
is checked with the flag on and ``name=sglang``. docs/verl.md's option table must list every
``SpecConfig`` field with its default. Not checked: the values of verl's own keys, which verl
validates when it builds its dataclasses.
"""
from __future__ import annotations

import dataclasses
import re

import pytest
from hydra.errors import HydraException

from doc_code import ROOT, DocCommand, code_texts, doc_launches, doc_texts, launches_in  # tests/ is on sys.path
from markdown_table import table_rows
from rollout_spec.config import SpecConfig
from rollout_spec.integrations.verl.config import FLAG_PATH, FLAG_VALUE, spec_from_rollout_config
from verl_hydra import compose_verl, hydra_value

VERL = "verl.trainer.main_ppo"
ROLLOUT = "actor_rollout_ref.rollout."
CUSTOM_OVERRIDE = re.compile(rf"\+{{0,2}}{re.escape(ROLLOUT)}custom\.\S+=\S+")


def check_verl_overrides(where: str, overrides: tuple[str, ...]) -> SpecConfig:
    """The overrides compose with verl's own config and turn rollout-spec on with options
    ``spec_from_rollout_config`` accepts."""
    try:
        config = compose_verl(overrides)
        spec = spec_from_rollout_config(config.actor_rollout_ref.rollout)
    except (HydraException, TypeError, ValueError) as exc:
        raise AssertionError(f"{where}\n  {exc}") from None
    assert spec is not None, f"{where}\n  does not set +{FLAG_PATH}={FLAG_VALUE}"
    return spec


def verl_override_spans() -> list[tuple[str, str]]:
    """``(doc, span)`` for every inline span that is one override under ``rollout.custom``."""
    return [(doc, text) for doc, text in doc_texts() if CUSTOM_OVERRIDE.fullmatch(text)]


def with_flag(span: str) -> tuple[str, ...]:
    """An override shown alone, with what a launch needs around it: the backend and the flag."""
    return (f"{ROLLOUT}name=sglang", f"+{FLAG_PATH}={FLAG_VALUE}", span)


def test_the_docs_show_the_overrides_this_test_checks() -> None:
    """Launches and lone overrides are found (else the checks below would pass vacuously)."""
    assert doc_launches(VERL)
    assert any(span.endswith("shared_index=my-job") for _, span in verl_override_spans())


@pytest.mark.parametrize("launch", doc_launches(VERL), ids=str)
def test_verl_launch_in_docs(launch: DocCommand) -> None:
    """The rollout overrides of the doc's verl launch turn rollout-spec on with valid options."""
    check_verl_overrides(str(launch), launch.argv)


@pytest.mark.parametrize("doc, span", verl_override_spans(), ids=lambda x: x)
def test_verl_override_in_docs(doc: str, span: str) -> None:
    """An override a doc shows alone is valid next to the flag."""
    check_verl_overrides(f"{doc}: `{span}`", with_flag(span))


def test_the_verl_option_table_lists_every_specconfig_field_with_its_default() -> None:
    """docs/verl.md's table of ``custom.rollout_spec.*`` options is ``SpecConfig``'s fields and defaults."""
    text = (ROOT / "docs" / "verl.md").read_text()
    rows = table_rows(text[text.index("## Options"):text.index("## How it hooks in")])
    documented = {row[0].strip("`"): hydra_value(row[1]) for row in rows}
    defaults = SpecConfig()
    fields = {f.name: getattr(defaults, f.name) for f in dataclasses.fields(SpecConfig)}
    assert documented == {name: list(v) if isinstance(v, tuple) else v for name, v in fields.items()}


VERL_LINE = "python3 -m verl.trainer.main_ppo ... actor_rollout_ref.rollout.name=sglang"
FLAG = f"+{FLAG_PATH}={FLAG_VALUE}"


@pytest.mark.parametrize("block, message", [
    (f"{VERL_LINE} {FLAG} +{ROLLOUT}custom.rollout_spec='{{num_draft_tokns: 8}}'", "num_draft_tokns"),
    (f"{VERL_LINE} {FLAG} +{ROLLOUT}custom.rollout_spec='{{history_steps: -1}}'", "history_steps"),
    (f"{VERL_LINE} {FLAG[1:]}", f"Could not override '{FLAG_PATH}'"),
    (f"{VERL_LINE} {FLAG} trainer.n_gpu_per_node=1", "Could not override 'trainer.n_gpu_per_node'"),
    (f"{VERL_LINE} {FLAG} +{ROLLOUT}custom.rollout_spec='{{num_draft_tokens 8}}'", "rollout_spec="),
    (f"{VERL_LINE} +{ROLLOUT}custom.speculativ=rollout_spec", "does not set"),
    (f"python3 -m verl.trainer.main_ppo {ROLLOUT}name=hf {FLAG}", "actor_rollout_ref.rollout.name"),
])
def test_a_broken_verl_launch_in_a_doc_is_refused(block: str, message: str) -> None:
    """A launch with a misspelt key (ours or verl's), a bad or malformed value, a missing ``+``
    or no flag fails its check."""
    [launch] = [launch for text in code_texts(f"```bash\n{block}\n```\n")
                for launch in launches_in("doc.md", text, (VERL,))]
    with pytest.raises(AssertionError, match=re.escape(message)):
        check_verl_overrides(str(launch), launch.argv)


def test_a_broken_verl_override_in_a_doc_is_refused() -> None:
    """A bad value in an override shown alone fails its check."""
    with pytest.raises(AssertionError, match="max_depth"):
        check_verl_overrides("doc.md", with_flag(f"+{ROLLOUT}custom.rollout_spec.max_depth=0"))

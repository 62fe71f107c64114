"""The ``--rollout_spec`` flag and its options, in OpenRLHF's dotted argparse style.

``--rollout_spec`` turns speculative rollouts on; ``--rollout_spec.<field>`` sets any
``SpecConfig`` field (e.g. ``--rollout_spec.num_draft_tokens 8``) and
``--rollout_spec.num_speculative_tokens`` the chain length vLLM verifies. ``tree`` defaults to
false here: vLLM verifies a single chain, so the drafter's whole budget goes into one. Values are validated by
``SpecConfig`` itself, so a bad one fails at launch with the field's name and range.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
from typing import Any, Optional, Sequence

from rollout_spec.config import SpecConfig, parse_bool
from rollout_spec.integrations.vllm.config import speculative_config

FLAG = "--rollout_spec"
PREFIX = "rollout_spec."


def _parse_bool(text: str) -> bool:
    """argparse's type for a bool option: a bad value is reported with its allowed spellings."""
    try:
        return parse_bool("value", text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--rollout_spec`` and one ``--rollout_spec.<field>`` per ``SpecConfig`` field."""
    group = parser.add_argument_group("rollout-spec (model-free speculative rollouts in vLLM)")
    group.add_argument(FLAG, action="store_true", default=False,
                       help="draft with rollout-spec's n-gram/suffix drafter in every vLLM engine")
    group.add_argument(f"{FLAG}.num_speculative_tokens", type=int, default=None, metavar="N",
                       help="draft tokens vLLM verifies per step (default: min(num_draft_tokens, max_depth))")
    defaults = SpecConfig()
    for f in dataclasses.fields(SpecConfig):
        default = getattr(defaults, f.name)
        kwargs: dict[str, Any] = {"default": None, "metavar": "VALUE",
                                  "help": f"SpecConfig.{f.name} (default {default!r})"}
        if isinstance(default, bool):
            kwargs["type"] = _parse_bool
        elif isinstance(default, tuple):
            kwargs["nargs"] = "*"
        elif default is None:  # optional names (shared_index)
            kwargs["type"] = str
        else:
            kwargs["type"] = type(default)
        group.add_argument(f"{FLAG}.{f.name}", **kwargs)


def spec_from_args(args: argparse.Namespace) -> Optional[tuple[SpecConfig, Optional[int]]]:
    """``(SpecConfig, num_speculative_tokens or None)`` when ``--rollout_spec`` is on, else None.

    Raises:
        ValueError: a ``--rollout_spec.*`` option was given without ``--rollout_spec``, a value
            is out of range (named by ``SpecConfig``), ``num_draft_tokens`` is 0 (speculation
            off: drop ``--rollout_spec``) or ``num_speculative_tokens`` is outside [1, 1024].
    """
    values = {k[len(PREFIX):]: v for k, v in vars(args).items() if k.startswith(PREFIX)}
    given = sorted(k for k, v in values.items() if v is not None)
    if not getattr(args, "rollout_spec", False):
        if given:
            raise ValueError(f"--rollout_spec.{given[0]} was given without --rollout_spec")
        return None
    k = values.pop("num_speculative_tokens", None)
    fields = {name: v for name, v in values.items() if v is not None}
    fields.setdefault("tree", False)  # vLLM verifies one chain: spend the whole budget on it
    try:
        spec = SpecConfig(**fields)
        if spec.num_draft_tokens == 0:
            raise ValueError("num_draft_tokens is 0 (speculation off): drop --rollout_spec instead")
        speculative_config(spec, k)  # k outside [1, 1024]: fail at launch
    except (TypeError, ValueError) as exc:  # each message starts with the field: name the flag
        raise type(exc)(f"{FLAG}.{exc}") from None
    return spec, k


def split_argv(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """Parse our options out of a launcher command line; the rest is OpenRLHF's. A
    ``--rollout_spec.*`` option that names no field (a misspelling) is an error here, with the
    nearest field's flag, instead of reaching OpenRLHF's parser."""
    parser = argparse.ArgumentParser(prog="rollout-spec", add_help=False, allow_abbrev=False)
    add_arguments(parser)
    ours, rest = parser.parse_known_args(list(argv))
    fields = ["num_speculative_tokens", *(f.name for f in dataclasses.fields(SpecConfig))]
    for arg in rest:
        flag = arg.split("=", 1)[0]
        if flag.startswith(FLAG):
            near = difflib.get_close_matches(flag[len(FLAG) + 1:], fields, n=1)
            hint = f"did you mean {FLAG}.{near[0]}?" if near else f"the options are {FLAG}.<SpecConfig field>"
            raise SystemExit(f"rollout-spec: unknown option {flag} ({hint})")
    return ours, rest

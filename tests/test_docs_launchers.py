"""The OpenRLHF and SGLang launches the docs show hold for rollout-spec's part of them.

test_docs_commands.py checks the programs of this repository (SGLang's replay tool among them);
this file and test_docs_verl.py check the launch lines of the frameworks we plug into, in the same
docs, read the same way (doc_code.py: ``python -m MODULE ARGS``, ``<placeholders>`` and ``...``
dropped). OpenRLHF and SGLang are never imported: their own options are passed over, and ours are
checked by the code that reads them at launch.

- OpenRLHF (``python -m rollout_spec.integrations.openrlhf.train_ppo_ray``): the launcher's
  ``main`` runs until it needs OpenRLHF (``require_openrlhf``), so its parser (no abbreviations)
  takes the ``--rollout_spec*`` options out, refuses a misspelt one and has ``SpecConfig``
  validate the values; the line must turn ``--rollout_spec`` on. An inline span that starts with
  ``--rollout_spec`` must name one of the launcher's options, and one with a value that is not a
  metavar (``K``, ``NAME``) is run too. ``--rollout_spec.<field>`` and ``--rollout_spec.*`` are
  patterns: not checked. The launcher error docs/openrlhf.md quotes must be the launcher's.
  Not checked: OpenRLHF's own flags (``--reward.remote_url``, ``--train.async_enable``, ...).
- SGLang (``python -m sglang.launch_server``): the ``ROLLOUT_SPEC_SGLANG`` value set before it in
  its doc is read by ``spec_from_env``, the plugin's reader, and the line's ``--speculative-*``
  options are exactly ``server_args`` of that spec, as docs/sglang.md says. Not checked: SGLang's
  other options (``--model-path``) and whether its parser has the ``--speculative-*`` ones.
"""
from __future__ import annotations

import argparse
import re
import shlex
from typing import Optional

import pytest

from doc_code import DocCommand, code_texts, doc_launches, doc_texts, launches_in  # tests/ is on sys.path
from rollout_spec.integrations.openrlhf import options as openrlhf_options
from rollout_spec.integrations.openrlhf import train_ppo_ray
from rollout_spec.integrations.sglang.config import ENV_VAR, server_args, spec_from_env

OPENRLHF = "rollout_spec.integrations.openrlhf.train_ppo_ray"
SGLANG = "sglang.launch_server"
METAVAR = re.compile(r"[A-Z]+")


class ReachedOpenRLHF(Exception):
    """Raised where the launcher would need OpenRLHF: our part of the line has been read."""


def run_openrlhf_launcher(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> None:
    """Run the OpenRLHF launcher's ``main`` on ``argv`` until it needs OpenRLHF.

    Raises:
        SystemExit: with the launcher's or its parser's message, for a misspelt option or a bad value.
    """
    def stop() -> None:
        raise ReachedOpenRLHF

    def error(self: argparse.ArgumentParser, message: str) -> None:
        raise SystemExit(f"{self.prog}: {message}")

    with monkeypatch.context() as patch:
        patch.setattr(train_ppo_ray, "require_openrlhf", stop)
        patch.setattr(argparse.ArgumentParser, "error", error)
        try:
            train_ppo_ray.main(argv)
        except ReachedOpenRLHF:
            return
    raise AssertionError("the launcher went on without checking for OpenRLHF")


def check_openrlhf_launch(monkeypatch: pytest.MonkeyPatch, launch: DocCommand) -> None:
    """The launcher reads our options of ``launch`` without an error, and they turn it on."""
    try:
        run_openrlhf_launcher(monkeypatch, list(launch.argv))
    except SystemExit as exc:
        raise AssertionError(f"{launch}\n  {exc}") from None
    assert "--rollout_spec" in launch.argv, f"{launch}\n  does not turn --rollout_spec on"


def launcher_options() -> set[str]:
    """The option strings of the OpenRLHF launcher's parser."""
    parser = argparse.ArgumentParser(add_help=False)
    openrlhf_options.add_arguments(parser)
    return {flag for action in parser._actions for flag in action.option_strings}


def openrlhf_mentions() -> list[tuple[str, str]]:
    """``(doc, span)`` for every inline span that starts with ``--rollout_spec`` and is no pattern."""
    spans = [(doc, text) for doc, text in doc_texts()
             if text.startswith("--rollout_spec") and not re.search(r"[<*]", text.split()[0])]
    return list(dict.fromkeys(spans))  # once per doc


def check_openrlhf_mention(monkeypatch: pytest.MonkeyPatch, doc: str, span: str) -> None:
    """The span's option is the launcher's; with a value that is no metavar, the launcher takes it."""
    name, *values = shlex.split(span)
    assert name in launcher_options(), f"{doc}: `{span}`\n  the launcher has no option {name}"
    if values and not METAVAR.fullmatch(values[0]):
        check_openrlhf_launch(monkeypatch, DocCommand(doc, OPENRLHF, ("--rollout_spec", name, *values)))


def env_values(text: str) -> list[str]:
    """The values a code text gives ``ROLLOUT_SPEC_SGLANG`` (``export ROLLOUT_SPEC_SGLANG='{...}'``)."""
    if f"{ENV_VAR}=" not in text:
        return []
    return [t.split("=", 1)[1] for t in shlex.split(text) if t.startswith(f"{ENV_VAR}=")]


def sglang_launches_with_env(texts: list[tuple[str, str]]) -> list[tuple[DocCommand, Optional[str]]]:
    """Each SGLang launch of ``(doc, code text)`` pairs with the ``ROLLOUT_SPEC_SGLANG`` value last
    set before it in its doc (None where there is none)."""
    found, env, last_doc = [], None, None
    for doc, text in texts:
        env = env if doc == last_doc else None
        last_doc = doc
        env = (env_values(text) or [env])[-1]
        found += [(launch, env) for launch in launches_in(doc, text, (SGLANG,))]
    return found


def speculative_options(argv: tuple[str, ...]) -> dict[str, str]:
    """The ``--speculative-*`` options of an SGLang command line and their values."""
    options = {}
    for i, arg in enumerate(argv):
        if arg.startswith("--speculative-"):
            name, _, value = arg.partition("=")
            options[name] = value or argv[i + 1]
    return options


def check_sglang_launch(launch: DocCommand, env: Optional[str]) -> None:
    """The exported JSON is a valid ``SpecConfig`` and the line's speculative options are its
    ``server_args``."""
    assert env is not None, f"{launch}\n  no {ENV_VAR} is set before it, so SGLang drafts without us"
    try:
        spec = spec_from_env({ENV_VAR: env})
    except (TypeError, ValueError) as exc:
        raise AssertionError(f"{launch}\n  {ENV_VAR}={env}: {exc}") from None
    expected = {f"--{key.replace('_', '-')}": str(value) for key, value in server_args(spec).items()}
    assert speculative_options(launch.argv) == expected, f"{launch}\n  server_args gives {expected}"


def test_the_docs_show_the_launches_this_test_checks() -> None:
    """Each kind of launch and span is found (else the checks below would pass vacuously)."""
    assert doc_launches(OPENRLHF) and sglang_launches_with_env(doc_texts())
    spans = {span.split()[0] for _, span in openrlhf_mentions()}
    assert {"--rollout_spec", "--rollout_spec.num_speculative_tokens", "--rollout_spec.shared_index"} <= spans


@pytest.mark.parametrize("launch", doc_launches(OPENRLHF), ids=str)
def test_openrlhf_launch_in_docs(monkeypatch: pytest.MonkeyPatch, launch: DocCommand) -> None:
    """The OpenRLHF launcher reads the doc's ``--rollout_spec*`` options and turns them on."""
    check_openrlhf_launch(monkeypatch, launch)


@pytest.mark.parametrize("doc, span", openrlhf_mentions(), ids=lambda x: x)
def test_openrlhf_option_in_docs(monkeypatch: pytest.MonkeyPatch, doc: str, span: str) -> None:
    """Each ``--rollout_spec*`` option a doc names is one of the launcher's; a value it shows is valid."""
    check_openrlhf_mention(monkeypatch, doc, span)


def test_the_error_docs_openrlhf_md_quotes_is_the_launchers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The message the doc quotes for a bad value is the one the launcher stops with."""
    quoted = [text for doc, text in doc_texts() if doc == "docs/openrlhf.md"
              and re.fullmatch(r"rollout-spec: --rollout_spec\.\w+ .*, got \S+", text)]
    assert quoted, "docs/openrlhf.md quotes no launcher error"
    for message in quoted:
        flag, value = re.search(r"(--rollout_spec\.\w+) .*got (\S+)", message).groups()
        with pytest.raises(SystemExit) as exc:
            run_openrlhf_launcher(monkeypatch, ["--rollout_spec", flag, value])
        assert str(exc.value) == message


@pytest.mark.parametrize("launch, env", sglang_launches_with_env(doc_texts()), ids=str)
def test_sglang_launch_in_docs(launch: DocCommand, env: Optional[str]) -> None:
    """The doc's ``ROLLOUT_SPEC_SGLANG`` is valid and its launch line has that spec's server args."""
    check_sglang_launch(launch, env)


OPENRLHF_LINE = "python -m rollout_spec.integrations.openrlhf.train_ppo_ray"
SGLANG_LINE = ("python -m sglang.launch_server --speculative-algorithm NGRAM --speculative-num-draft-tokens {}"
               " --speculative-ngram-max-trie-depth 64")


@pytest.mark.parametrize("block, message", [
    (f"{OPENRLHF_LINE} --rollout_spec --rollout_spec.num_draft_token 8 <the usual arguments>",
     "did you mean --rollout_spec.num_draft_tokens"),
    (f"{OPENRLHF_LINE} --rollout_spec --rollout_spec.num_dra 8", "unknown option --rollout_spec.num_dra"),
    (f"{OPENRLHF_LINE} --rollout_spec --rollout_spec.group_weight -1", "group_weight"),
    (f"{OPENRLHF_LINE} --rollout_spec.num_draft_tokens 8", "given without --rollout_spec"),
    (f"{OPENRLHF_LINE} --rollout_spe", "does not turn --rollout_spec on"),
])
def test_a_broken_openrlhf_launch_in_a_doc_is_refused(
        monkeypatch: pytest.MonkeyPatch, block: str, message: str) -> None:
    """A launch line with a misspelt or shortened option, a bad value or no flag fails its check."""
    [launch] = [launch for text in code_texts(f"```bash\n{block}\n```\n")
                for launch in launches_in("doc.md", text, (OPENRLHF,))]
    with pytest.raises(AssertionError, match=re.escape(message)):
        check_openrlhf_launch(monkeypatch, launch)


@pytest.mark.parametrize("span, message", [
    ("--rollout_spec.num_speculative_token K", "no option --rollout_spec.num_speculative_token"),
    ("--rollout_spec.shared_index ''", "shared_index"),
])
def test_a_broken_openrlhf_option_in_a_doc_is_refused(
        monkeypatch: pytest.MonkeyPatch, span: str, message: str) -> None:
    """A misspelt option or a bad value shown inline fails its check."""
    with pytest.raises(AssertionError, match=re.escape(message)):
        check_openrlhf_mention(monkeypatch, "doc.md", span)


@pytest.mark.parametrize("block, message", [
    (f"export {ENV_VAR}='{{\"num_draft_token\": 8}}'\n{SGLANG_LINE.format(9)}", "num_draft_token"),
    (f"export {ENV_VAR}='{{\"num_draft_tokens\": 8}}'\n{SGLANG_LINE.format(8)}", "server_args gives"),
    (SGLANG_LINE.format(9), f"no {ENV_VAR}"),
])
def test_a_broken_sglang_launch_in_a_doc_is_refused(block: str, message: str) -> None:
    """A bad ``ROLLOUT_SPEC_SGLANG``, server args that do not match it, or none, fail the check."""
    texts = [("doc.md", text) for text in code_texts(f"```bash\n{block}\n```\n")]
    [(launch, env)] = sglang_launches_with_env(texts)
    with pytest.raises(AssertionError, match=re.escape(message)):
        check_sglang_launch(launch, env)

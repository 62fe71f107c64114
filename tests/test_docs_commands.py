"""The command lines the docs show parse with the real parsers: every option exists, spelt in full,
and every value is in its range, so the docs cannot drift from the code unnoticed.

Commands are read from README.md, examples/README.md and docs/*.md, but for the lab notebooks
(docs/drafter-log.md, docs/gpu.md), whose commands are history. They come from fenced blocks
(lines joined at a trailing backslash, ``#`` comments dropped) and from inline code spans (joined
across a paragraph's line breaks). A command is ``rollout-spec bench|replay ...``,
``bench/NAME.py ...`` (or a bare ``NAME.py`` of bench/), ``examples/[DIR/]NAME.py ...`` or
``python -m rollout_spec.integrations.sglang.replay ...``; its arguments run to the end of the
span or to a shell operator, and the brackets of optional parts are dropped. A span that names a
program without arguments mentions it, and one that ends in an option without its value
(``rollout-spec bench --record``) names the option: only that name is checked there.

Each command runs its entry point's own ``main`` with ``ArgumentParser.parse_args`` stopped right
after parsing, so nothing runs, and with abbreviations off, so a shortened option is refused.
docs/bench.md's option tables must list every option of ``rollout-spec bench`` and ``replay``, and
of every script in bench/, and no other, with the parser's defaults; and each of those programs'
``--help``, and that of the examples' scripts and the SGLang replay, states every option's set
default (``cli_args.DefaultsParser``).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable, Optional

import pytest

from doc_code import ROOT, DocCommand, arguments_after, code_texts, doc_files  # tests/ is on sys.path under pytest
from markdown_table import table_rows

SGLANG_REPLAY = "rollout_spec.integrations.sglang.replay"
PROGRAM = re.compile(
    r"(?<![\w/.-])(?:\.venv/bin/)?(?P<cli>rollout-spec\s+(?:bench|replay))\b"
    r"|(?<![\w/.-])(?P<script>(?:bench/|examples/(?:\w+/)?)?\w+\.py)\b"
    rf"|(?<![\w/.-])python3?\s+-m\s+(?P<module>{re.escape(SGLANG_REPLAY)})\b")
NEEDS_VALUE = "expected one argument"
OPTIONAL_PACKAGES = ("ray", "vllm", "sglang", "triton")


def commands_in(doc: str, text: str) -> list[DocCommand]:
    """The commands of one code text (see the module's docstring for what counts as one)."""
    found = []
    matches = list(PROGRAM.finditer(text))
    for i, match in enumerate(matches):
        program = re.sub(r"\s+", " ", match.group("cli") or match.group("script") or match.group("module"))
        if match.group("script") and _script_path(match.group("script")) is None:
            continue  # some other file (rollout_spec/workloads.py, make_prompts.py)
        argv = tuple(t.strip("[]") for t in arguments_after(text, matches, i) if t.strip("[]"))
        if argv:
            found.append(DocCommand(doc, program, argv))
    return found


def _script_path(name: str) -> Optional[Path]:
    """bench/ or examples/ script ``name`` (a bare name is bench/'s), or None if there is none."""
    path = ROOT / name if "/" in name else ROOT / "bench" / name
    return path if path.is_file() else None


def doc_commands() -> list[DocCommand]:
    """Every command of every checked doc."""
    return [cmd for path in doc_files()
            for text in code_texts(path.read_text())
            for cmd in commands_in(str(path.relative_to(ROOT)), text)]


class Parsed(Exception):
    """Raised in place of returning from ``parse_args``: the command parsed; nothing runs."""


class Refused(Exception):
    """Raised in place of argparse's exit: the parser refused the command line."""


def _load_script(path: Path) -> ModuleType:
    """Import a bench/ or examples/ script as a module (bench/ on sys.path for its siblings)."""
    name = f"doc_command_{path.stem}"
    if name in sys.modules:
        return sys.modules[name]
    if str(ROOT / "bench") not in sys.path:
        sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the script runs
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def entry_point(program: str) -> Callable[[list[str]], object]:
    """The ``main(argv)`` that runs ``program``; skips the test when an optional package it
    imports is not installed here."""
    try:
        if program.startswith("rollout-spec "):
            cli = importlib.import_module("rollout_spec.cli")
            return lambda argv: cli.main([program.split()[1], *argv])
        if program == SGLANG_REPLAY:
            return importlib.import_module(SGLANG_REPLAY).main
        return _load_script(_script_path(program)).main
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] in OPTIONAL_PACKAGES:
            pytest.skip(f"{program} needs {exc.name}, not installed here")
        raise


def parse_only(monkeypatch: pytest.MonkeyPatch, main: Callable[[list[str]], object], argv: list[str]) -> None:
    """Parse ``argv`` with the parser ``main`` builds, without running anything.

    Raises:
        Refused: with argparse's message, for an unknown or abbreviated option or a bad value.
    """
    init = argparse.ArgumentParser.__init__

    def init_without_abbrev(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        kwargs["allow_abbrev"] = False
        init(self, *args, **kwargs)

    def error(self: argparse.ArgumentParser, message: str) -> None:
        raise Refused(f"{self.prog}: {message}")

    parse_args = argparse.ArgumentParser.parse_args

    def parse_and_stop(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        raise Parsed(parse_args(self, *args, **kwargs))

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "__init__", init_without_abbrev)
        patch.setattr(argparse.ArgumentParser, "error", error)
        patch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
        try:
            main(list(argv))
        except Parsed:
            return
    raise AssertionError("the entry point returned without parsing its arguments")


def check_command(monkeypatch: pytest.MonkeyPatch, cmd: DocCommand) -> None:
    """Parse ``cmd`` with its program's parser; a trailing option without its value is a mention
    of that option, so the line is parsed again without it.

    Raises:
        Refused: naming the doc, the command and argparse's message.
    """
    main = entry_point(cmd.program)
    argv = list(cmd.argv)
    try:
        parse_only(monkeypatch, main, argv)
    except Refused as exc:
        names_last_option = argv[-1].startswith("--") and str(exc).endswith(f"{argv[-1]}: {NEEDS_VALUE}")
        if not names_last_option:
            raise Refused(f"{cmd}\n  {exc}") from None
        if len(argv) > 1:
            check_command(monkeypatch, DocCommand(cmd.doc, cmd.program, tuple(argv[:-1])))


def test_the_docs_show_the_commands_this_test_checks() -> None:
    """The extraction finds every kind of command (else the check below would pass vacuously)."""
    programs = {cmd.program for cmd in doc_commands()}
    assert {"rollout-spec bench", "rollout-spec replay", "examples/grpo_tiny.py", SGLANG_REPLAY,
            "bench/drafter_bench.py", "bench/engine_bench.py", "bench/verify_bench.py",
            "bench/shared_index_bench.py", "bench/vllm_proposer_bench.py",
            "examples/verl/make_gsm_data.py", "examples/openrlhf/make_prompts.py"} <= programs


@pytest.mark.parametrize("cmd", doc_commands(), ids=str)
def test_doc_command_parses(monkeypatch: pytest.MonkeyPatch, cmd: DocCommand) -> None:
    """Every option a doc's command uses exists in its program's parser, and its value is in range."""
    check_command(monkeypatch, cmd)


@pytest.mark.parametrize("line, message", [
    ("rollout-spec bench --device cpu --max-new-token 16", "unrecognized arguments: --max-new-token"),
    ("rollout-spec bench --max-new 16", "unrecognized arguments: --max-new"),  # an abbreviation
    ("rollout-spec replay t.json --draft-tokens 0", "--draft-tokens must be"),
    ("python bench/drafter_bench.py --max-live 512 --drafters ours,artic", "--drafters value"),
    ("python examples/verl/make_gsm_data.py --out d --train-size 0", "--train-size must be in [1,"),
])
def test_a_misspelt_or_out_of_range_command_in_a_doc_is_refused(
        monkeypatch: pytest.MonkeyPatch, line: str, message: str) -> None:
    """The check fails on a doc whose command has a misspelt or shortened option or a bad value."""
    doc = f"Run it:\n\n```bash\n{line}   # a comment\n```\n"
    [cmd] = [c for text in code_texts(doc) for c in commands_in("doc.md", text)]
    with pytest.raises(Refused, match=re.escape(message)):
        check_command(monkeypatch, cmd)


def test_an_inline_span_ending_in_an_option_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """``rollout-spec bench --record`` in prose names the option: accepted; a misspelt one is not."""
    doc = "A trace (`rollout-spec bench --record`) and (`rollout-spec bench\n--recrod`)."
    cmds = [c for text in code_texts(doc) for c in commands_in("doc.md", text)]
    assert [c.argv for c in cmds] == [("--record",), ("--recrod",)]
    check_command(monkeypatch, cmds[0])
    with pytest.raises(Refused, match="unrecognized arguments: --recrod"):
        check_command(monkeypatch, cmds[1])


def option_tables() -> list[list[list[str]]]:
    """The data rows of docs/bench.md's option tables: ``rollout-spec bench``'s, then ``replay``'s."""
    text = (ROOT / "docs" / "bench.md").read_text()
    section = text[text.index("## Options"):text.index("## Figures")]
    blocks = re.findall(r"(?:^\|.*\n)+", section, flags=re.M)
    return [table_rows(block) for block in blocks]


def documented_default(default: object) -> str:
    """How the option tables write a parser default: ``off`` for a flag, else the value."""
    return "off" if default is False else str(default)


@pytest.mark.parametrize("command, table", [("bench", 0), ("replay", 1)])
def test_the_option_tables_of_docs_bench_md_match_the_parser(command: str, table: int) -> None:
    """docs/bench.md lists every option of the subcommand, no other, each with the parser's
    default where the parser has one (a row of several options lists their defaults in order)."""
    from rollout_spec.cli import _parsers

    parser = _parsers()[1][command]
    actions = {flag: action for action in parser._actions for flag in action.option_strings}
    rows = option_tables()[table]
    listed = [re.findall(r"--[a-z][\w-]*", row[0]) for row in rows]
    assert sorted(f for flags in listed for f in flags) == sorted(set(actions) - {"-h", "--help"})
    for flags, row in zip(listed, rows):
        defaults = [actions[f].default for f in flags]
        if all(d is None for d in defaults):
            continue  # prose: "32 on CUDA, 8 elsewhere", "-", "all"
        cells = [c.strip().strip("`") for c in row[1].split(",")]
        assert cells == [documented_default(d) for d in defaults], row


BENCH_SCRIPTS = sorted(f"bench/{p.name}" for p in (ROOT / "bench").glob("*.py") if p.stem != "trace_files")


def script_tables() -> dict[str, list[list[str]]]:
    """The data rows of the option table under each ``### `bench/NAME.py``` heading of
    docs/bench.md, by script."""
    text = (ROOT / "docs" / "bench.md").read_text()
    section = text[text.index("## The scripts in `bench/`"):]
    parts = re.split(r"^### `(bench/\w+\.py)`\n", section, flags=re.M)
    return {script: table_rows(body) for script, body in zip(parts[1::2], parts[2::2])}


def script_parser(monkeypatch: pytest.MonkeyPatch, program: str) -> argparse.ArgumentParser:
    """The parser ``program``'s ``main`` builds, taken when it is about to parse (nothing runs)."""
    main = entry_point(program)
    built = []

    def capture(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        built.append(self)
        raise Parsed(None)

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", capture)
        with pytest.raises(Parsed):
            main([])
    return built[0]


def documented_script_default(default: object) -> Optional[str]:
    """How a script's option table writes a parser default, or None where it says it in prose
    (an unset option, a path beside the checkout)."""
    if default is None or default == [] or isinstance(default, Path):
        return None
    return ",".join(map(str, default)) if isinstance(default, list) else documented_default(default)


@pytest.mark.parametrize("script", BENCH_SCRIPTS)
def test_docs_bench_md_lists_every_option_of_each_bench_script(monkeypatch: pytest.MonkeyPatch,
                                                                script: str) -> None:
    """Each bench script has a table in docs/bench.md with all its options, no other, one per row,
    each with the parser's default."""
    tables = script_tables()
    assert script in tables, f"docs/bench.md has no table for {script}"
    parser = script_parser(monkeypatch, script)
    actions = {flag: action for action in parser._actions for flag in action.option_strings}
    listed = [re.findall(r"--[a-z][\w-]*", row[0]) for row in tables[script]]
    assert all(len(flags) == 1 for flags in listed), listed
    assert sorted(flags[0] for flags in listed) == sorted(set(actions) - {"-h", "--help"})
    for [flag], row in zip(listed, tables[script]):
        default = actions[flag].default
        if isinstance(default, Path):  # the shared trace beside the checkout: the doc names its tail
            assert str(default).endswith(row[1].strip("`")), row
        elif documented_script_default(default) is not None:
            assert row[1].strip("`") == documented_script_default(default), row


def program_parser(monkeypatch: pytest.MonkeyPatch, program: str) -> argparse.ArgumentParser:
    """The parser of a bench or examples script (``bench/NAME.py``, ``examples/[DIR/]NAME.py``),
    of the SGLang replay module, or of a ``rollout-spec`` subcommand."""
    if program.startswith("rollout-spec "):
        from rollout_spec.cli import _parsers

        return _parsers()[1][program.split()[1]]
    return script_parser(monkeypatch, program)


EXAMPLE_SCRIPTS = ["examples/grpo_tiny.py", "examples/openrlhf/make_prompts.py",
                   "examples/verl/make_gsm_data.py"]


@pytest.mark.parametrize("program", ["rollout-spec bench", "rollout-spec replay", *BENCH_SCRIPTS,
                                     *EXAMPLE_SCRIPTS, SGLANG_REPLAY])
def test_help_states_every_option_default(monkeypatch: pytest.MonkeyPatch, program: str) -> None:
    """``--help`` shows "(default: VALUE)" for every option whose default is set (not None, an off
    flag or an empty list), with the value the parser uses, and no help names a default twice."""
    from rollout_spec.cli_args import shown_default, states_default

    parser = program_parser(monkeypatch, program)
    shown = "".join(parser.format_help().split())  # wrapping may break a value, even a word (a path)
    for action in parser._actions:
        if not action.option_strings or action.help is argparse.SUPPRESS:
            continue
        flag, text = action.option_strings[-1], action.help or ""
        assert text.replace("%(default)s", "").lower().count("default") <= 1, f"{flag}: {text!r}"
        if states_default(action.default):
            value = shown_default(action.default)
            assert value in text, f"{flag}: its help does not show its default"
            value = action.default if value == "%(default)s" else value.replace("%%", "%")
            assert "".join(f"(default: {value}".split()) in shown, f"{flag}: {value} not in --help"

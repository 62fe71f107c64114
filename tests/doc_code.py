"""Reading the docs whose code must hold, for the tests that check their command lines
(test_docs_commands.py, test_docs_launchers.py, test_docs_verl.py)."""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ("drafter-log.md", "gpu.md")
"""The lab notebooks of docs/: their commands are history, so they are not checked."""
LAUNCH = re.compile(r"(?<![\w/.-])python3?\s+-m\s+(?P<module>[\w.]+)")
PLACEHOLDER = re.compile(r"(?<!\S)(?:<[^<>]*>|\.\.\.)(?!\S)")
SHELL_END = re.compile(r"\s(?:>|2>|\||&&|;)|$")


def doc_files() -> list[Path]:
    """The docs whose commands must hold: README.md, examples/README.md, docs/*.md but the notebooks."""
    docs = sorted(p for p in (ROOT / "docs").glob("*.md") if p.name not in NOTEBOOKS)
    return [ROOT / "README.md", ROOT / "examples" / "README.md", *docs]


def code_texts(markdown: str) -> list[str]:
    """The shell lines of fenced blocks and the inline code spans of ``markdown``, one string each."""
    texts: list[str] = []
    prose: list[str] = []
    fence: Optional[list[str]] = None
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            if fence is None:
                fence = []
            else:
                texts += _fenced_lines(fence)
                fence = None
        elif fence is not None:
            fence.append(line)
        else:
            prose.append(line)
    for paragraph in re.split(r"\n\s*\n", "\n".join(prose)):
        texts += [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", paragraph)]
    return texts


def _fenced_lines(lines: list[str]) -> list[str]:
    """A fenced block's commands: continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [re.sub(r"(^|\s)#.*", "", line) for line in joined.splitlines()]


def doc_texts() -> list[tuple[str, str]]:
    """``(doc, code text)`` for every code text of every checked doc, in the docs' order."""
    return [(str(path.relative_to(ROOT)), text) for path in doc_files() for text in code_texts(path.read_text())]


@dataclass(frozen=True)
class DocCommand:
    """One command line shown in a doc: where it is, which program (a CLI, a script or a
    ``python -m`` module), and its arguments."""

    doc: str
    program: str
    argv: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.doc}: {self.program} {' '.join(self.argv)}"


def arguments_after(text: str, matches: list[re.Match], i: int) -> list[str]:
    """The shell words after ``matches[i]`` (a program's name in ``text``): they run to the next
    match, to a shell operator or to the end of the text."""
    stop = matches[i + 1].start() if i + 1 < len(matches) else len(text)
    rest = text[matches[i].end():stop]
    return shlex.split(rest[:SHELL_END.search(rest).start()])


def launches_in(doc: str, text: str, modules: tuple[str, ...]) -> list[DocCommand]:
    """The ``python -m`` launches of ``modules`` in one code text (``arguments_after``);
    ``<placeholders>`` and ``...`` are dropped."""
    text = PLACEHOLDER.sub(" ", text)
    matches = [m for m in LAUNCH.finditer(text) if m.group("module") in modules]
    return [DocCommand(doc, match.group("module"), tuple(arguments_after(text, matches, i)))
            for i, match in enumerate(matches)]


def doc_launches(module: str) -> list[DocCommand]:
    """Every launch of ``module`` in the checked docs."""
    return [launch for doc, text in doc_texts() for launch in launches_in(doc, text, (module,))]

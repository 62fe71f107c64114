"""Reading the markdown tables that bench scripts print, for the tests that run them."""
from __future__ import annotations


def table_rows(out: str) -> list[list[str]]:
    """The data rows of every markdown table in ``out``, cells stripped: each line that starts
    with "| ", but the header lines (those followed by a "|---" separator line)."""
    lines = out.splitlines()
    rows = []
    for i, line in enumerate(lines):
        header = i + 1 < len(lines) and lines[i + 1].startswith("|---")
        if line.startswith("| ") and not header:
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows

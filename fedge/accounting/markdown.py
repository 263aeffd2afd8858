"""Markdown tables for reports and the command line, written by ``tabulate`` (its ``pipe`` format, as GitHub renders
it): the cost tables, the simulator's run reports, the experiment and benchmark scripts."""

from __future__ import annotations

from collections.abc import Sequence

from tabulate import tabulate


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]], align: str = "") -> str:
    """``rows`` under ``header`` as a Markdown table, one line per row, ending in a newline.

    Cells are shown exactly as given (no number is parsed and reformatted: "0.50" stays "0.50") with ``|`` escaped.
    ``align``: one letter per column, ``l`` (left) or ``r`` (right, its rule ending in ``:``); default all left.
    """
    if any(len(row) != len(header) for row in rows):
        raise ValueError(f"every row of a table needs {len(header)} cells")
    align = align or "l" * len(header)
    if len(align) != len(header) or set(align) - {"l", "r"}:
        raise ValueError(f"align {align!r} must give l or r for each of the {len(header)} columns")
    colalign = ["right" if a == "r" else "left" for a in align]
    text = tabulate(
        [[_cell(c) for c in row] for row in rows],
        headers=[_cell(h) for h in header],
        tablefmt="pipe",
        colalign=colalign,
        disable_numparse=True,
    )
    return text + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")

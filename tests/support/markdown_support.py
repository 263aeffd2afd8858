"""Reading the Markdown tables that reports and scripts write (fedge.accounting.markdown): cells, not padding."""

from __future__ import annotations

import re


def table_rows(text: str) -> list[list[str]]:
    """Every table line of ``text`` (header, rule and body rows) as its stripped cells."""
    lines = [line.strip() for line in text.splitlines() if line.startswith("|")]
    return [[c.strip() for c in re.split(r"(?<!\\)\|", line[1:-1])] for line in lines]  # an escaped \| is text


def has_row(text: str, *cells: str) -> bool:
    """Whether a table row of ``text`` starts with ``cells``."""
    return any(row[: len(cells)] == list(cells) for row in table_rows(text))

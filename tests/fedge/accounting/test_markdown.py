"""fedge.accounting.markdown: the one writer of Markdown tables (tabulate's pipe format)."""

from __future__ import annotations

import pytest

from fedge.accounting.markdown import markdown_table


def test_cells_are_written_as_given_escaped_and_aligned_per_column() -> None:
    table = markdown_table(["run", "acc|%", "bytes"], [["a|b", "0.50", "1,234"], ["c", "", "9 kB"]], "lrr")
    assert table.splitlines() == [
        "| run   |   acc\\|% |   bytes |",
        "|:------|---------:|--------:|",
        "| a\\|b  |     0.50 |   1,234 |",  # "0.50" is not parsed into 0.5, "|" does not split the cell
        "| c     |          |    9 kB |",
    ]
    assert table.endswith("|\n")


def test_columns_are_left_aligned_unless_told_and_shapes_must_agree() -> None:
    assert markdown_table(["x", "y"], [["1", "2"]]).splitlines()[1] == "|:----|:----|"
    with pytest.raises(ValueError, match="every row of a table needs 2 cells"):
        markdown_table(["x", "y"], [["1"]])
    with pytest.raises(ValueError, match="align 'r' must give l or r for each of the 2 columns"):
        markdown_table(["x", "y"], [["1", "2"]], "r")
    with pytest.raises(ValueError, match="align 'lc' must give"):
        markdown_table(["x", "y"], [["1", "2"]], "lc")

"""Communication cost: DS-FL Tables I-II and III (ComU@I) recomputed from fedge's models, and the arithmetic."""

from __future__ import annotations

import pytest
from markdown_support import has_row, table_rows

from fedge.accounting.cost import (
    CostRow,
    RoundCost,
    algorithm_round_cost,
    cost_table_markdown,
    open_dataset_cost,
    paper_tables,
    round_cost,
)
from fedge.accounting.units import format_bytes
from fedge.algorithms.catalog import get_algorithm
from fedge.errors import ConfigError

# DS-FL Tables I and II, per-round totals as printed in the paper.
PAPER_FIGURES = {
    ("MNIST", "fl"): "236.1 MB",
    ("MNIST", "fd"): "40.4 kB",
    ("MNIST", "dsfl"): "4.0 MB",
    ("Fashion-MNIST", "fl"): "1.1 GB",
    ("Fashion-MNIST", "fd"): "40.4 kB",
    ("Fashion-MNIST", "dsfl"): "4.0 MB",
    ("IMDb", "fd"): "176 B",
    ("IMDb", "dsfl"): "88 kB",
    ("Reuters", "fd"): "93 kB",
    ("Reuters", "dsfl"): "2.0 MB",
}


@pytest.fixture(scope="module")
def table() -> dict[tuple[str, str], CostRow]:
    return {(r.task, r.method): r for r in paper_tables()}


def test_paper_tables_layout(table: dict[tuple[str, str], CostRow]) -> None:
    rows = paper_tables()
    assert [(r.task, r.method) for r in rows] == [
        (task, method) for task in ("MNIST", "Fashion-MNIST", "IMDb", "Reuters") for method in ("fl", "fd", "dsfl")
    ]
    assert all(r.total == r.bytes_up + r.bytes_down for r in rows)


@pytest.mark.parametrize(("key", "figure"), PAPER_FIGURES.items(), ids=lambda v: str(v))
def test_paper_figures_exact(table: dict[tuple[str, str], CostRow], key: tuple[str, str], figure: str) -> None:
    # The paper prints "93 kB" and "88 kB" without a decimal place; compare at the precision it printed.
    decimals = len(figure.split()[0].partition(".")[2])
    assert format_bytes(table[key].total, decimals) == figure


@pytest.mark.parametrize(("task", "paper_mb"), [("IMDb", 28.6), ("Reuters", 228.8)])
def test_paper_text_fl_within_one_percent(table: dict[tuple[str, str], CostRow], task: str, paper_mb: float) -> None:
    # The paper's IMDb and Reuters model sizes differ slightly from its own stated parameter counts.
    assert table[(task, "fl")].total / 1e6 == pytest.approx(paper_mb, rel=0.01)


def test_paper_byte_values(table: dict[tuple[str, str], CostRow]) -> None:
    assert table[("MNIST", "fl")].total == 101 * 584_458 * 4
    assert table[("MNIST", "fd")].total == 101 * 10 * 10 * 4
    assert table[("Reuters", "dsfl")].total == 11 * 1000 * 46 * 4


def test_fd_protocol_carries_client_counts(table: dict[tuple[str, str], CostRow]) -> None:
    fd = table[("Reuters", "fd")]
    assert fd.protocol_extra_down == 46 * 4  # one int32 |K_n| per class, one broadcast copy
    assert fd.protocol_total == fd.total + 46 * 4
    assert table[("Reuters", "dsfl")].protocol_extra_down == 0  # the index set travels as a seed
    assert table[("Reuters", "fl")].protocol_extra_down == 0


def test_unicast_vs_multicast_by_hand() -> None:
    # 3 clients, 4 classes, a 10-value model, 5 open samples per round.
    assert round_cost("fl", num_clients=3, num_classes=4, model_values=10) == RoundCost(120, 40)
    assert round_cost("fl", num_clients=3, num_classes=4, model_values=10, accounting="unicast") == RoundCost(120, 120)
    assert round_cost("fd", num_clients=3, num_classes=4) == RoundCost(192, 64, 16)
    assert round_cost("fd", num_clients=3, num_classes=4, accounting="unicast") == RoundCost(192, 192, 48)
    assert round_cost("dsfl", num_clients=3, num_classes=4, open_per_round=5) == RoundCost(240, 80)
    assert round_cost("dsfl", num_clients=3, num_classes=4, open_per_round=5, accounting="unicast") == RoundCost(
        240, 240
    )
    assert RoundCost(192, 64, 16).total == 256
    assert RoundCost(192, 64, 16).protocol_total == 272


def test_unicast_paper_tables() -> None:
    rows = {(r.task, r.method): r for r in paper_tables("unicast")}
    assert rows[("MNIST", "fl")].total == 200 * 584_458 * 4
    assert rows[("IMDb", "fd")].total == 20 * 2 * 2 * 4


def test_round_cost_errors() -> None:
    with pytest.raises(ConfigError, match="model_values"):
        round_cost("fl", num_clients=3, num_classes=4)
    with pytest.raises(ConfigError, match="unknown method 'fedavg'"):
        round_cost("fedavg", num_clients=3, num_classes=4, model_values=10)
    with pytest.raises(ConfigError, match="unknown accounting"):
        round_cost("fd", num_clients=3, num_classes=4, accounting="broadcast")
    with pytest.raises(ConfigError, match="num_clients"):
        round_cost("fd", num_clients=0, num_classes=4)


def test_algorithm_round_cost_prices_an_algorithm_by_its_own_traffic_model() -> None:
    """``fedge cost --model``'s rows: FedAvg moves the model once each way, SCAFFOLD its control variate as well."""

    def cost(algorithm: str, accounting: str = "multicast") -> RoundCost:
        traffic = get_algorithm(algorithm).traffic
        shape = (1, 28, 28)
        return algorithm_round_cost(
            traffic, model="fedavg_cnn", input_shape=shape, num_classes=10, num_clients=3, accounting=accounting
        )

    fedavg, scaffold, unicast = cost("fedavg"), cost("scaffold"), cost("fedavg", "unicast")
    assert fedavg == RoundCost(bytes_up=3 * 1_663_370 * 4, bytes_down=1_663_370 * 4)
    assert scaffold == RoundCost(bytes_up=2 * fedavg.bytes_up, bytes_down=2 * fedavg.bytes_down)
    assert unicast.bytes_down == 3 * fedavg.bytes_down


def test_open_dataset_cost_matches_table_iii() -> None:
    # DS-FL Table III ComU@I: float32 images, 16-bit IMDb token ids (200 per review), 1-bit Reuters bag-of-words.
    for num_open, gb in [(5000, 0.016), (10000, 0.031), (20000, 0.063), (40000, 0.13)]:
        assert round(open_dataset_cost(num_open, 784) / 1e9, 3 if gb < 0.1 else 2) == gb
    assert format_bytes(open_dataset_cost(10000, 200, bits_per_value=16)) == "4.0 MB"
    assert format_bytes(open_dataset_cost(5000, 10000, bits_per_value=1)) == "6.3 MB"
    assert open_dataset_cost(5000, 784, num_clients=100, accounting="unicast") == 100 * 5000 * 784 * 4


def test_format_bytes() -> None:
    assert format_bytes(0) == "0 B"
    assert format_bytes(176) == "176 B"
    assert format_bytes(999) == "999 B"
    assert format_bytes(1000) == "1.0 kB"
    assert format_bytes(40_400) == "40.4 kB"
    assert format_bytes(999_960) == "1.0 MB"  # not "1000.0 kB"
    assert format_bytes(236_121_032) == "236.1 MB"
    assert format_bytes(1_115_957_888) == "1.1 GB"
    assert format_bytes(93_104, 0) == "93 kB"
    with pytest.raises(ConfigError, match="must not be negative, got -1"):
        format_bytes(-1)


def test_cost_table_markdown() -> None:
    rows = paper_tables()
    paper = table_rows(cost_table_markdown(rows, layout="paper"))
    assert paper[0] == ["Method", "MNIST", "Fashion-MNIST", "IMDb", "Reuters"]
    assert paper[2] == ["FL", "236.1 MB", "1.1 GB", "28.5 MB", "228.6 MB"]
    assert paper[3] == ["FD", "40.4 kB", "40.4 kB", "176 B", "93.1 kB"]
    long = table_rows(cost_table_markdown(rows))
    assert long[0] == ["Task", "Method", "Upload", "Download", "Total", "Total (fedge)"]
    assert long[3] == ["MNIST", "FD", "40.0 kB", "400 B", "40.4 kB", "40.4 kB"]
    assert len(long) == 2 + len(rows)
    # Text columns left-aligned, byte counts right-aligned, columns padded to a width (tabulate's pipe format).
    assert cost_table_markdown([CostRow("t", "fl", 8, 4)]).splitlines() == [
        "| Task   | Method   |   Upload |   Download |   Total |",
        "|:-------|:---------|---------:|-----------:|--------:|",
        "| t      | FL       |      8 B |        4 B |    12 B |",
    ]


def test_compressed_costs_price_the_paper_tables_under_each_scheme() -> None:
    from fedge.accounting.cost import DSFL_PAPER_TASKS, compressed_costs, compressed_table_markdown

    rows = {(r.task, r.method, r.upload): r for r in compressed_costs(["float32", "int8:tensor", "topk:k=1"])}
    base = rows[("MNIST", "dsfl", "float32")]
    assert base.total == base.float32_total == 4_040_000  # DS-FL Table I: 4.0 MB
    int8 = rows[("MNIST", "dsfl", "int8:tensor")]
    assert int8.bytes_up == 100 * (1000 * 10 + 4)  # one byte per value plus one float32 scale per message
    top1 = rows[("MNIST", "dsfl", "topk:row,k=1")]
    assert top1.bytes_up == 100 * 1000 * (4 + 1 + 4)  # value, uint8 index, dropped mass per row
    fl = rows[("MNIST", "fl", "int8:tensor")]
    assert (
        fl.broadcast == "float32" and fl.bytes_down == rows[("MNIST", "fl", "float32")].bytes_down
    )  # weights: no int8 broadcast
    assert len(rows) == 3 * 3 * len(DSFL_PAPER_TASKS)
    assert has_row(compressed_table_markdown(list(rows.values())), "MNIST", "DS-FL", "int8:tensor", "int8:tensor")

"""Per-round communication cost of FL, FD and DS-FL, as tensor-level bytes (DS-FL paper, Section 4.2, Tables I-II).

The paper's cost model counts only the tensors a round exchanges, as 32-bit floats:

- FL (benchmark 1, eq. 1-3): every client uploads its model, the server sends the global model back.
- FD (benchmark 2, eq. 4-6): every client uploads its per-class average outputs (C x C), the server sends the global
  per-class averages (C x C).
- DS-FL (eq. 9-11): every client uploads its outputs on the round's open samples (|o_r| x C), the server sends the
  aggregated outputs (|o_r| x C).

Two accounting models for the server-to-client direction: ``"multicast"`` (one broadcast copy, as the paper assumes:
"broadcasts ... via multicast channels") and ``"unicast"`` (one copy per client, as over per-client MQTT topics).

Where fedge's protocol sends more or less than the paper's model, :class:`RoundCost` says so separately: the FD
broadcast also carries the C per-class client counts |K_n| (int32) that the leave-one-out target of eq. (6) needs,
while the DS-FL open-sample index set travels as a seed and adds no tensor bytes. Message framing (headers, MQTT) is
not counted here; the wire codec measures that.

All byte figures use decimal units (1 kB = 1e3 B, 1 MB = 1e6 B, 1 GB = 1e9 B), as the paper does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeAlias, get_args

import torch

from fedge.accounting.markdown import markdown_table
from fedge.accounting.units import format_bytes
from fedge.compression import codecs as cz
from fedge.errors import ConfigError
from fedge.learning.models import build_model, num_exchanged_values, num_trainable_parameters
from fedge.registry import get_algorithm

Method: TypeAlias = Literal["fl", "fd", "dsfl"]
"""Exchange pattern: model parameters (FL: FedAvg, FedNTD, FedCAD, ...), per-class outputs (FD), open-set outputs
(DS-FL)."""

Accounting: TypeAlias = Literal["multicast", "unicast"]
"""How the download is counted: one broadcast copy, or one copy per client."""


@dataclass(frozen=True)
class CostInputs:
    """What the per-round cost of an algorithm depends on (tensor level, float32 values)."""

    model_values: int  # exchanged state: parameters plus batch-norm statistics
    trainable_values: int  # parameters only
    num_classes: int
    num_clients: int  # participating clients per round
    open_per_round: int = 1000  # DS-FL |o_r|
    secure_aggregation: bool = False  # the masked uploads (what an algorithm masks beyond its plain upload counted)


@dataclass(frozen=True)
class RoundTraffic:
    """Tensor bytes one round moves: per-client upload, one broadcast copy, and protocol extras beyond the paper's
    cost model (FD's per-class client counts)."""

    up_per_client: int
    down_broadcast: int
    protocol_extra_down: int = 0


METHOD_LABELS: dict[str, str] = {"fl": "FL", "fd": "FD", "dsfl": "DS-FL"}
"""Display names, as in the paper's tables."""

FLOAT32_BYTES = 4
INT32_BYTES = 4


@dataclass(frozen=True)
class RoundCost:
    """Bytes one round moves, summed over all clients.

    ``bytes_up`` and ``bytes_down`` follow the paper's cost model; ``protocol_extra_down`` is what fedge's protocol
    sends on top of it (zero except for FD's per-class client counts).
    """

    bytes_up: int
    bytes_down: int
    protocol_extra_down: int = 0

    @property
    def total(self) -> int:
        """Paper-model bytes per round (uploads plus downloads)."""
        return self.bytes_up + self.bytes_down

    @property
    def protocol_total(self) -> int:
        """Bytes per round under fedge's protocol."""
        return self.total + self.protocol_extra_down


@dataclass(frozen=True)
class CostRow:
    """One table row: a task, a method and its per-round bytes (``total`` = ``bytes_up`` + ``bytes_down``)."""

    task: str
    method: str  # "fl", "fd", "dsfl" (the paper's methods) or a registered algorithm's name
    bytes_up: int
    bytes_down: int
    protocol_extra_down: int = 0
    total: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "total", self.bytes_up + self.bytes_down)

    @property
    def protocol_total(self) -> int:
        """Bytes per round under fedge's protocol."""
        return self.total + self.protocol_extra_down


@dataclass(frozen=True)
class PaperTask:
    """A DS-FL evaluation setting (Section 4.1) that Tables I-II price."""

    name: str
    model: str
    input_shape: tuple[int, ...]
    num_classes: int
    num_clients: int
    open_per_round: int = 1000  # |o_r|, "the amount of unlabeled data used in each round"
    open_sizes: tuple[int, ...] = ()  # the open set sizes I^o of Table III
    open_bits_per_value: int = 32  # what Table III's ComU@I implies per value of an open sample


DSFL_PAPER_TASKS: tuple[PaperTask, ...] = (
    PaperTask("MNIST", "dsfl_mnist_cnn", (1, 28, 28), 10, 100, open_sizes=(5000, 10000, 20000, 40000)),
    PaperTask("Fashion-MNIST", "dsfl_fmnist_cnn", (1, 28, 28), 10, 100, open_sizes=(5000, 10000, 20000, 40000)),
    PaperTask("IMDb", "imdb_lstm", (200,), 2, 10, open_sizes=(10000,), open_bits_per_value=16),  # token ids
    PaperTask("Reuters", "reuters_mlp", (10000,), 46, 10, open_sizes=(5000,), open_bits_per_value=1),  # binary words
)
"""Tables I (image) and II (text) of the DS-FL paper, in the paper's column order, with Table III's open sets."""


def _positive(name: str, value: int) -> None:
    if value < 1:
        raise ConfigError(f"{name} must be at least 1, got {value}")


def _copies(accounting: str, num_clients: int) -> int:
    """How many copies of one broadcast payload the download counts."""
    if accounting not in get_args(Accounting):
        raise ConfigError(f"unknown accounting {accounting!r}; choose one of {', '.join(get_args(Accounting))}")
    return 1 if accounting == "multicast" else num_clients


def round_cost(
    method: str,
    *,
    num_clients: int,
    num_classes: int,
    model_values: int | None = None,
    open_per_round: int = 1000,
    accounting: str = "multicast",
) -> RoundCost:
    """Tensor bytes of one round with ``num_clients`` participating clients (DS-FL Section 4.2 cost model).

    ``model_values`` (the exchanged state size, see :func:`fedge.learning.models.num_exchanged_values`) is required for
    ``"fl"``; ``open_per_round`` (|o_r|) is used by ``"dsfl"``.
    """
    _positive("num_clients", num_clients)
    _positive("num_classes", num_classes)
    copies = _copies(accounting, num_clients)
    if method == "fl":
        if model_values is None:
            raise ConfigError("FL cost needs model_values (the number of exchanged model values)")
        _positive("model_values", model_values)
        payload = model_values * FLOAT32_BYTES
        return RoundCost(bytes_up=num_clients * payload, bytes_down=copies * payload)
    if method == "fd":
        payload = num_classes * num_classes * FLOAT32_BYTES  # per-class average output vectors, eq. (4)-(5)
        counts = num_classes * INT32_BYTES  # |K_n| per class, for eq. (6) on the client
        return RoundCost(
            bytes_up=num_clients * payload, bytes_down=copies * payload, protocol_extra_down=copies * counts
        )
    if method == "dsfl":
        _positive("open_per_round", open_per_round)
        payload = open_per_round * num_classes * FLOAT32_BYTES  # one output vector per open sample in o_r
        # The server picks o_r from a seed it sends in the task config, so the index set adds no tensor bytes.
        return RoundCost(bytes_up=num_clients * payload, bytes_down=copies * payload)
    raise ConfigError(f"unknown method {method!r}; choose one of {', '.join(get_args(Method))}")


def algorithm_round_cost(
    traffic: Callable[[CostInputs], RoundTraffic],
    *,
    model: str,
    input_shape: tuple[int, ...],
    num_classes: int,
    num_clients: int,
    open_per_round: int = 1000,
    accounting: str = "multicast",
    secure_aggregation: bool = False,
) -> RoundCost:
    """Tensor bytes of one round of an algorithm, from its own traffic model (``Algorithm.traffic``, e.g. SCAFFOLD
    sends a control variate both ways, twice FedAvg's parameters). ``secure_aggregation``: each upload as masked (FD
    masks its per-class holds too); the protocol's keys and shares are not tensors of the algorithm and not counted."""
    _positive("num_clients", num_clients)
    _positive("num_classes", num_classes)
    copies = _copies(accounting, num_clients)
    with torch.device("meta"):  # count values without allocating them
        net = build_model(model, input_shape=input_shape, num_classes=num_classes)
    inputs = CostInputs(
        model_values=num_exchanged_values(net),
        trainable_values=num_trainable_parameters(net),
        num_classes=num_classes,
        num_clients=num_clients,
        open_per_round=open_per_round,
        secure_aggregation=secure_aggregation,
    )
    t = traffic(inputs)
    return RoundCost(
        bytes_up=num_clients * t.up_per_client,
        bytes_down=copies * t.down_broadcast,
        protocol_extra_down=copies * t.protocol_extra_down,
    )


def open_dataset_cost(
    num_open: int,
    sample_numel: int,
    *,
    num_clients: int = 1,
    accounting: str = "multicast",
    bits_per_value: int = 32,
) -> int:
    """One-time bytes to give every client the open (unlabeled) dataset: DS-FL Table III's ComU@I.

    ``num_open`` samples (I^o) of ``sample_numel`` values at ``bits_per_value`` bits each, sent once (multicast) or
    to each of ``num_clients`` clients (unicast). The paper's figures imply 32 bits per pixel for the images, 16 bits
    per token id for IMDb and 1 bit per vocabulary entry for Reuters' binary bag-of-words.
    """
    _positive("num_open", num_open)
    _positive("sample_numel", sample_numel)
    _positive("bits_per_value", bits_per_value)
    _positive("num_clients", num_clients)
    return _copies(accounting, num_clients) * math.ceil(num_open * sample_numel * bits_per_value / 8)


def open_dataset_table(accounting: str = "multicast") -> str:
    """DS-FL Table III's ComU@I for every paper task and open set size, as a Markdown table: what DS-FL pays once,
    before its first round, and what its per-round saving must repay."""
    rows = []
    for task in DSFL_PAPER_TASKS:
        numel = math.prod(task.input_shape)
        for size in task.open_sizes:
            cost = open_dataset_cost(
                size,
                numel,
                num_clients=task.num_clients,
                accounting=accounting,
                bits_per_value=task.open_bits_per_value,
            )
            rows.append([task.name, f"{size:,}", f"{numel:,} x {task.open_bits_per_value} bit", format_bytes(cost)])
    return markdown_table(["Task", "Open samples (I^o)", "Per sample", "ComU@I"], rows, "lrrr")


def task_costs(task: PaperTask, accounting: str = "multicast") -> list[CostRow]:
    """FL, FD and DS-FL rows for one setting, with the FL size counted from fedge's own model definition."""
    # Meta tensors: count the model's values without allocating or initializing them (Reuters' MLP has 5.2M).
    with torch.device("meta"):
        model = build_model(task.model, input_shape=task.input_shape, num_classes=task.num_classes)
    values = num_exchanged_values(model)
    rows = []
    for method in get_args(Method):
        cost = round_cost(
            method,
            num_clients=task.num_clients,
            num_classes=task.num_classes,
            model_values=values,
            open_per_round=task.open_per_round,
            accounting=accounting,
        )
        rows.append(CostRow(task.name, method, cost.bytes_up, cost.bytes_down, cost.protocol_extra_down))
    return rows


def paper_tables(accounting: str = "multicast") -> list[CostRow]:
    """DS-FL Tables I and II recomputed from fedge's models: FL, FD and DS-FL rows for MNIST, Fashion-MNIST, IMDb
    and Reuters, in that order. With ``"multicast"`` the totals match the paper's figures.
    """
    return [row for task in DSFL_PAPER_TASKS for row in task_costs(task, accounting)]


def method_label(method: str) -> str:
    """ "FL", "FD", "DS-FL" for the paper's methods; a registered algorithm's display name otherwise."""
    if method in METHOD_LABELS:
        return METHOD_LABELS[method]
    return get_algorithm(method).label


def cost_table_markdown(rows: Sequence[CostRow], *, layout: Literal["long", "paper"] = "long") -> str:
    """A Markdown table of cost rows.

    ``"long"``: one line per row with upload, download and total, plus a "Total (fedge)" column when any row's
    protocol differs from the paper's model. ``"paper"``: the DS-FL Tables I-II layout, methods down and tasks
    across, paper-model totals in the cells.
    """
    if layout == "paper":
        tasks = list(dict.fromkeys(r.task for r in rows))
        methods = list(dict.fromkeys(r.method for r in rows))
        cells = {(r.task, r.method): format_bytes(r.total) for r in rows}
        table = [[method_label(m), *(cells.get((t, m), "-") for t in tasks)] for m in methods]
        return markdown_table(["Method", *tasks], table, "l" + "r" * len(tasks))
    if layout != "long":
        raise ConfigError(f"unknown table layout {layout!r}; choose 'long' or 'paper'")
    protocol = any(r.protocol_extra_down for r in rows)
    header = ["Task", "Method", "Upload", "Download", "Total"] + (["Total (fedge)"] if protocol else [])
    table = []
    for r in rows:
        cols = [r.task, method_label(r.method), *map(format_bytes, (r.bytes_up, r.bytes_down, r.total))]
        if protocol:
            cols.append(format_bytes(r.protocol_total))
        table.append(cols)
    return markdown_table(header, table, "ll" + "r" * (len(header) - 2))


# --- compressed transfers --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CompressedRow:
    """One method of one paper task under one compression scheme: coded tensor bytes per round and the ratio."""

    task: str
    method: str
    upload: str  # the scheme's command-line form (fedge.compression.codecs.Scheme.text)
    broadcast: str
    bytes_up: int
    bytes_down: int
    float32_total: int  # the same round uncompressed (the paper's figure)

    @property
    def total(self) -> int:
        return self.bytes_up + self.bytes_down


def _exchanged_specs(task: PaperTask, method: str) -> dict[str, cz.TensorSpec]:
    """The tensors one upload of ``method`` carries (float32), by name and shape."""
    c = task.num_classes
    if method == "fd":
        return {"class_probs": cz.TensorSpec((c, c))}
    if method == "dsfl":
        return {"soft_labels": cz.TensorSpec((task.open_per_round, c))}
    with torch.device("meta"):
        model = build_model(task.model, input_shape=task.input_shape, num_classes=c)
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return {k: cz.TensorSpec(tuple(v.shape), v.dtype) for k, v in state.items()}


def compressed_costs(
    schemes: Sequence[str], tasks: Sequence[PaperTask] = DSFL_PAPER_TASKS, accounting: str = "multicast"
) -> list[CompressedRow]:
    """DS-FL Tables I-II rows (FL, FD, DS-FL) with uploads and broadcast compressed by each of ``schemes``.

    Outputs (FD, DS-FL) are compressed row by row, weights (FL) per tensor, as runs do
    (:mod:`fedge.compression.strategy`); a weight broadcast can only be float16, so FL's broadcast stays float32 under
    int8 and top-k. Bytes are those
    of the coded tensors (codes, scales, offsets, indices, dropped masses), with the schemes' exact layouts.
    """
    rows = []
    for text in schemes:
        for task in tasks:
            copies = _copies(accounting, task.num_clients)
            for method in get_args(Method):
                weights = method == "fl"
                scheme = cz.Scheme.parse(text, granularity="tensor" if weights else "row")
                down = scheme if not weights or scheme.name in ("float32", "float16") else cz.Scheme()
                specs = _exchanged_specs(task, method)
                up_bytes = task.num_clients * cz.coded_bytes(specs, scheme)
                down_bytes = copies * cz.coded_bytes(specs, down)
                raw = task.num_clients * cz.raw_bytes(specs) + copies * cz.raw_bytes(specs)
                rows.append(CompressedRow(task.name, method, scheme.text, down.text, up_bytes, down_bytes, raw))
    return rows


def compressed_table_markdown(rows: Sequence[CompressedRow]) -> str:
    """A Markdown table of compressed cost rows with the share of the uncompressed figure."""
    header = ["Task", "Method", "Upload", "Broadcast", "Upload bytes", "Download bytes", "Total", "of float32"]
    table = []
    for r in rows:
        share = f"{100.0 * r.total / r.float32_total:.1f}%" if r.float32_total else "-"
        sizes = [format_bytes(r.bytes_up), format_bytes(r.bytes_down), format_bytes(r.total)]
        table.append([r.task, method_label(r.method), r.upload, r.broadcast, *sizes, share])
    return markdown_table(header, table, "llllrrrr")

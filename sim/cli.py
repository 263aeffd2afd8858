"""User-facing output of ``fedge sim``, ``fedge cost`` and ``fedge report``: progress bars, tables, file paths."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from fedge.accounting.records import RoundRecord
from fedge.accounting.units import format_bytes
from fedge.config import RunConfig
from fedge.errors import ConfigError
from fedge.privacy.summary import privacy_line
from fedge_io.console import round_line, skipped_rounds_status
from fedge_io.tensorboard import TensorBoardLog, check_tensorboard

if TYPE_CHECKING:
    from fedge_io.rundir import RunResult


def run_sim(args: argparse.Namespace, config: RunConfig) -> int:
    from fedge_io.rundir import run_directory

    if args.transport == "mqtt" and args.executor not in ("auto", "sequential"):
        raise ConfigError(f"--executor {args.executor} is for in-process runs; over MQTT every client is a process")
    if args.transport == "mqtt" and args.overlap != "auto":
        raise ConfigError("--overlap is for in-process runs; over MQTT the coordinator evaluates between rounds")
    if args.transport == "mqtt" and config.simulated_time:
        raise ConfigError(
            "--client-profiles, --link and --sim-deadline simulate time in process; over MQTT time is real"
        )
    if args.tensorboard is not None:
        check_tensorboard()  # before a run directory exists
    with run_directory(args.out, config, args.name, resume=args.resume) as run_dir:  # removed if the start fails
        result = _simulate(args, config, run_dir)
    s = result.summary
    print(f"run directory: {result.path}")
    if s.get("final_accuracy") is not None:
        print(
            f"final accuracy {100 * s['final_accuracy']:.2f}%  best {100 * s['best_accuracy']:.2f}%  "
            f"forgetting F {s['final_forgetting']:.3f}"
        )
    if (spent := privacy_line(s)) is not None:
        print(spent)
    if "time_to" in s:
        clock = s["sim_clock"]
        reached = ", ".join(f"{100 * float(k):g}% after {v:,.1f} s" for k, v in s["time_to"].items() if v is not None)
        print(
            f"simulated time: {clock['total_s']:,.1f} s ({clock['link']}: {clock['link_figures']})"
            + (f"; reached {reached}" if reached else "")
        )
    if s.get("stopped"):
        print(f"stopped early: {s['stopped']}")
    tb = s.get("total_bytes", {})
    print(
        f"communication (tensor level): {format_bytes(tb.get('tensor_bytes_multicast', 0))} multicast, "
        f"{format_bytes(tb.get('tensor_bytes_unicast', 0))} unicast; payload "
        f"{format_bytes(tb.get('payload_bytes_unicast', 0))} unicast"
    )
    if not args.no_report:
        from sim.report import write_report

        report = write_report([result.path], result.path)
        print(f"report: {report}")
    return skipped_rounds_status(s, allowed=args.allow_skipped_rounds)


def _simulate(args: argparse.Namespace, config: RunConfig, run_dir: Path) -> RunResult:
    """Run the simulation into ``run_dir`` with a progress bar and per-round lines."""
    from tqdm import tqdm

    resume = args.resume is not None
    # Redirected to a log, a bar is a stream of carriage returns: draw it on terminals only; the per-round lines
    # go to both, flushed, so a run of hours can be followed with `tail -f`.
    bar = tqdm(
        total=config.rounds,
        desc=f"{config.algorithm} on {config.dataset}",
        unit="round",
        disable=args.quiet or not sys.stderr.isatty(),
        file=sys.stderr,
        dynamic_ncols=True,
    )
    tensorboard = TensorBoardLog(args.tensorboard, run_dir.name) if args.tensorboard is not None else None

    def on_round(r: RoundRecord) -> None:
        if tensorboard is not None:
            tensorboard.round(r)
        if resume and bar.n == 0:  # count (and time) a resumed run from the journal's round, not from 0
            bar.initial = bar.n = bar.last_print_n = r.round - 1
        acc = r.accuracy
        b = r.bytes
        bar.set_postfix_str(
            (f"acc {100 * acc:5.2f}% " if acc is not None else "")
            + f"round {format_bytes(b.tensor['multicast'])} cum {format_bytes(b.cum_tensor['multicast'])}"
        )
        bar.update(1)
        if not args.quiet:
            clock = f"  sim clock {r.metrics['sim_clock_s']:,.1f} s" if "sim_clock_s" in r.metrics else ""
            bar.write(round_line(r) + clock, file=sys.stdout)
            sys.stdout.flush()

    try:
        return _run(args, config, run_dir, on_round, resume)
    finally:
        bar.close()
        if tensorboard is not None:
            tensorboard.close()


def _run(
    args: argparse.Namespace, config: RunConfig, run_dir: Path, on_round: Callable[[RoundRecord], None], resume: bool
) -> RunResult:
    if args.transport == "mqtt":
        from sim.laptop import run_over_mqtt

        result = run_over_mqtt(
            config,
            run_dir,
            broker=args.broker,
            device=args.device,
            on_round=on_round,
            resume=resume,
            max_packet_size=args.max_packet_size,
        )
    else:
        from sim.run import run_inprocess

        result = run_inprocess(
            config,
            run_dir,
            device=args.device,
            on_round=on_round,
            resume=resume,
            executor=args.executor,
            workers=args.workers,
            threads_per_worker=args.threads_per_worker,
            overlap={"auto": None, "on": True, "off": False}[args.overlap],
        )
    return result


def run_cost(args: argparse.Namespace) -> int:
    from fedge.accounting.cost import (
        CostRow,
        algorithm_round_cost,
        cost_table_markdown,
        open_dataset_table,
        paper_tables,
    )
    from fedge.algorithms.catalog import ALGORITHMS
    from fedge.learning.models import build_model, num_exchanged_values

    accountings = ["multicast", "unicast"] if args.accounting == "both" else [args.accounting]
    secure = bool(getattr(args, "secure_aggregation", False))
    if secure and not args.model:
        raise SystemExit(
            "fedge cost: --secure-aggregation prices the algorithms of a --model (the paper tables are the papers' "
            "plain rounds), e.g. --model fedavg_cnn --input-shape 1,28,28 --secure-aggregation"
        )
    out = []
    for acc in accountings:
        if args.model:
            if not args.input_shape:
                raise SystemExit("fedge cost: --model needs --input-shape, e.g. --input-shape 1,28,28")
            shape = tuple(int(v) for v in args.input_shape.split(","))
            model = build_model(args.model, input_shape=shape, num_classes=args.num_classes)
            values = num_exchanged_values(model)
            rows = []
            for name, spec in ALGORITHMS.items():  # every registered algorithm, from its own traffic model
                c = algorithm_round_cost(
                    spec.traffic,
                    model=args.model,
                    input_shape=shape,
                    num_classes=args.num_classes,
                    num_clients=args.num_clients,
                    open_per_round=args.open_per_round,
                    accounting=acc,
                    secure_aggregation=secure,
                )
                rows.append(CostRow(args.model, name, c.bytes_up, c.bytes_down, c.protocol_extra_down))
            masked = ", uploads as secure aggregation masks them (its keys and shares not counted)" if secure else ""
            title = (
                f"Per-round communication, {args.model} ({values:,} values), {args.num_clients} clients, "
                f"{args.num_classes} classes, |o_r| = {args.open_per_round} ({acc}{masked})"
            )
            out.append(f"## {title}\n\n{cost_table_markdown(rows)}")
        else:
            rows = paper_tables(acc)
            out.append(
                f"## DS-FL Tables I and II from fedge's models ({acc})\n\n"
                f"{cost_table_markdown(rows, layout='paper')}\n{cost_table_markdown(rows)}"
            )
            out.append(
                f"## DS-FL Table III's ComU@I: the open dataset sent to the clients once, before round 1 ({acc})\n\n"
                f"{open_dataset_table(acc)}"
            )
        if getattr(args, "compress", None):
            from fedge.accounting.cost import compressed_costs, compressed_table_markdown

            compressed = compressed_costs(["float32", *args.compress], accounting=acc)
            out.append(
                f"## DS-FL Tables I and II with compressed transfers ({acc})\n\n{compressed_table_markdown(compressed)}"
            )
    text = "\n".join(out)
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    return 0


def run_report(args: argparse.Namespace) -> int:
    from sim.report import write_report
    from sim.report.runs import not_a_run

    runs = []
    for path in args.runs:  # a glob such as runs/*-fedavg-* may also match a failed start or another directory
        reason = not_a_run(path)
        if reason is None:
            runs.append(path)
        else:
            print(f"fedge report: skipping {path}: it {reason}", file=sys.stderr)
    if not runs:
        raise ConfigError(
            "no run directory to report on (pass directories written by `fedge sim` or `fedge coordinator`)"
        )
    out = args.out or (args.runs[0] if len(args.runs) == 1 else Path("report"))
    path = write_report(runs, out, accounting=args.accounting)
    print(f"report: {path}")
    return 0

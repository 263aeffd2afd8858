"""User-facing output of ``fedge sim``, ``fedge cost`` and ``fedge report``: progress bars, tables, file paths."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from fedge.config import RunConfig
from fedge.cost import format_bytes


def run_sim(args: argparse.Namespace, config: RunConfig) -> int:
    from tqdm import tqdm

    from common.rundir import new_run_dir

    run_dir = new_run_dir(args.out, config, args.name)
    bar = tqdm(
        total=config.rounds,
        desc=f"{config.algorithm} on {config.dataset}",
        unit="round",
        disable=args.quiet,
        file=sys.stderr,
        dynamic_ncols=True,
    )

    def on_round(r: dict[str, Any]) -> None:
        acc = r.get("accuracy")
        bar.set_postfix_str(
            (f"acc {100 * acc:5.2f}% " if acc is not None else "")
            + f"round {format_bytes(r['tensor_bytes_multicast'])} cum {format_bytes(r['cum_tensor_bytes_multicast'])}"
        )
        bar.update(1)
        if args.quiet:
            return
        line = f"round {r['round']:3d}"
        if acc is not None:
            line += f"  acc {100 * acc:6.2f}%  F {r['forgetting']:.3f}"
        if "global_logit_entropy" in r:
            line += f"  H {r['global_logit_entropy']:.3f}"
        line += (
            f"  up {format_bytes(r['tensor_bytes_up'])}  down {format_bytes(r['tensor_bytes_down_multicast'])}"
            f"  cum {format_bytes(r['cum_tensor_bytes_multicast'])}"
        )
        if r.get("dropped"):
            line += f"  dropped {','.join(r['dropped'])}"
        bar.write(line)

    if args.transport == "mqtt":
        from sim.laptop import run_over_mqtt

        result = run_over_mqtt(config, run_dir, broker=args.broker, device=args.device, on_round=on_round)
    else:
        from sim.run import run_inprocess

        result = run_inprocess(config, run_dir, device=args.device, on_round=on_round)
    bar.close()
    s = result.summary
    print(f"run directory: {result.path}")
    if s.get("final_accuracy") is not None:
        print(
            f"final accuracy {100 * s['final_accuracy']:.2f}%  best {100 * s['best_accuracy']:.2f}%  "
            f"forgetting F {s['final_forgetting']:.3f}"
        )
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
    return 0


def run_cost(args: argparse.Namespace) -> int:
    from fedge.cost import CostRow, cost_table_markdown, paper_tables, round_cost
    from fedge.models import build_model, num_exchanged_values

    accountings = ["multicast", "unicast"] if args.accounting == "both" else [args.accounting]
    out = []
    for acc in accountings:
        if args.model:
            if not args.input_shape:
                raise SystemExit("fedge cost: --model needs --input-shape, e.g. --input-shape 1,28,28")
            shape = tuple(int(v) for v in args.input_shape.split(","))
            model = build_model(args.model, input_shape=shape, num_classes=args.num_classes)
            values = num_exchanged_values(model)
            rows = []
            for method in ("fl", "fd", "dsfl"):
                c = round_cost(
                    method,
                    num_clients=args.num_clients,
                    num_classes=args.num_classes,
                    model_values=values,
                    open_per_round=args.open_per_round,
                    accounting=acc,
                )
                rows.append(CostRow(args.model, method, c.bytes_up, c.bytes_down, c.protocol_extra_down))
            title = (
                f"Per-round communication, {args.model} ({values:,} values), {args.num_clients} clients, "
                f"{args.num_classes} classes, |o_r| = {args.open_per_round} ({acc})"
            )
            out.append(f"## {title}\n\n{cost_table_markdown(rows)}")
        else:
            rows = paper_tables(acc)
            out.append(
                f"## DS-FL Tables I and II from fedge's models ({acc})\n\n"
                f"{cost_table_markdown(rows, layout='paper')}\n{cost_table_markdown(rows)}"
            )
    text = "\n".join(out)
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    return 0


def run_report(args: argparse.Namespace) -> int:
    from sim.report import write_report

    out = args.out or (args.runs[0] if len(args.runs) == 1 else Path("report"))
    path = write_report(args.runs, out, accounting=args.accounting)
    print(f"report: {path}")
    return 0

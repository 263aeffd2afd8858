"""``fedge coordinator``: run rounds over a broker for clients started elsewhere; user-facing output only here."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from fedge.config import RunConfig

log = logging.getLogger(__name__)


def add_coordinator_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``fedge coordinator`` (the run's config flags are added by cli.main)."""
    p.add_argument("--broker", required=True, help="mqtt://HOST:PORT of the broker")
    p.add_argument(
        "--run",
        default="default",
        help="the run (federation) name: topic prefix fedge/<run>/, same as the clients' --run",
    )
    p.add_argument(
        "--min-clients",
        type=int,
        default=None,
        help="clients that must be online before round 1 (default: --num-clients)",
    )
    p.add_argument("--round-timeout", type=float, default=300.0, help="seconds a round waits for replies")
    p.add_argument("--join-timeout", type=float, default=600.0, help="seconds to wait for --min-clients clients")
    p.add_argument(
        "--rejoin-grace",
        type=float,
        default=5.0,
        help="seconds a client that went offline mid-round may take to return",
    )
    p.add_argument(
        "--broker-counters",
        choices=["auto", "on", "off"],
        default="auto",
        help="compare our wire bytes with the broker's $SYS byte counters (auto: when the broker publishes them)",
    )
    p.add_argument("--out", type=Path, default=Path("runs"), help="parent directory of the run directory")
    p.add_argument("--name", default="", help="label appended to the run directory's name")
    p.add_argument("--no-report", action="store_true", help="skip the Markdown report and plots")


def run_coordinator_cli(args: argparse.Namespace, config: RunConfig) -> int:
    from common.rundir import new_run_dir
    from coordinator.run import run_coordinator
    from fedge.cost import format_bytes

    run_dir = new_run_dir(args.out, config, args.name)
    print(f"run directory: {run_dir}", flush=True)

    def on_round(r: dict[str, Any]) -> None:
        line = f"round {r['round']:3d}  replied {len(r['replied'])}/{len(r['sampled'])}"
        if r.get("accuracy") is not None:
            line += f"  acc {100 * r['accuracy']:6.2f}%"
        line += f"  tensor {format_bytes(r['tensor_bytes_multicast'])}  wire {format_bytes(r['wire_bytes'])}"
        line += f"  {r['wall_s']:.1f} s"
        if r.get("dropped"):
            line += "  dropped " + ", ".join(f"{c} ({r.get('drop_reasons', {}).get(c, '?')})" for c in r["dropped"])
        if r.get("rejected"):
            line += f"  rejected {len(r['rejected'])}"
        print(line, flush=True)

    result = run_coordinator(
        config,
        run_dir,
        broker=args.broker,
        run=args.run,
        min_clients=args.min_clients,
        round_timeout=args.round_timeout,
        join_timeout=args.join_timeout,
        rejoin_grace=args.rejoin_grace,
        broker_counters=args.broker_counters != "off",
        on_round=on_round,
    )
    s = result.summary
    if s.get("final_accuracy") is not None:
        print(f"final accuracy {100 * s['final_accuracy']:.2f}%  best {100 * s['best_accuracy']:.2f}%")
    tb = s.get("total_bytes", {})
    print(
        f"communication: tensor {format_bytes(tb.get('tensor_bytes_multicast', 0))} multicast / "
        f"{format_bytes(tb.get('tensor_bytes_unicast', 0))} unicast, wire {format_bytes(s.get('wire_bytes', 0))}"
    )
    bb = s.get("broker_bytes")
    if bb:
        print(f"broker $SYS: {format_bytes(bb['broker_total'])} ({bb['diff_pct']:+.2f}% vs our wire count)")
    elif args.broker_counters == "on":
        log.warning("the broker published no $SYS byte counters (mosquitto needs sys_interval > 0)")
    if s.get("drops"):
        print("dropped: " + "; ".join(f"round {d['round']} {d['client']} ({d['reason']})" for d in s["drops"]))
    if s.get("rejected"):
        print(f"rejected messages: {s['rejected']} {s.get('rejected_by_reason', {})}")
    if not args.no_report:
        from sim.report import write_report

        print(f"report: {write_report([result.path], result.path)}")
    return 0

"""``fedge provision``: each client's data file and the run's config.json, and with ``--fleet-broker`` a
secure fleet kit (broker files, bundles, systemd units) and the commands that start it."""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from fedge_cli.flags import (
    HelpFormatter,
    add_config_flags,
    add_plugin_flag,
    config_from_args,
    packet_size,
    resolved_plugins,
)

HELP = "write each client's data file (and the run's config.json) for a deployment"
"""The one-line help of ``fedge provision`` (``fedge --help`` lists it)."""


def _service_user(name: str) -> str:
    """``--service-user``'s check at parse time, so that a bad name is refused before anything is written."""
    from coordinator.kit.services import service_user
    from fedge.errors import ConfigError

    try:
        return service_user(name)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add(sub: argparse._SubParsersAction) -> None:
    """The ``provision`` subcommand and its flags."""
    p = sub.add_parser(
        "provision",
        help=HELP,
        formatter_class=HelpFormatter,
    )
    p.add_argument("--out", type=Path, required=True, help="directory for <client>.safetensors, shared and config")
    p.add_argument(
        "--fleet-broker",
        action="append",
        default=[],
        metavar="HOST",
        help="also write a secure fleet kit to OUT/kit for a broker that devices reach as HOST (repeat for more "
        "names): per-device passwords, ACL, mosquitto.conf with TLS, a private CA; one bundle per device",
    )
    p.add_argument("--run", default="default", help="the run (federation) name the kit is for")
    p.add_argument("--fleet-port", type=int, default=0, help="the broker's port (default: 8883, or 1883 with --no-tls)")
    p.add_argument(
        "--client-certificates",
        action="store_true",
        help="mutual TLS: a certificate for every device, and the broker takes its login from the certificate",
    )
    p.add_argument(
        "--signed-programs",
        action="store_true",
        help="device bundles require on-device programs signed by the kit's CA (fedge export --sign-key KIT); "
        "such a client never exports programs itself",
    )
    p.add_argument(
        "--fleet-bind",
        default=None,
        metavar="ADDRESS",
        help="the one address the kit's broker listens on, e.g. 127.0.0.1 or a LAN address (default: every interface)",
    )
    p.add_argument(
        "--fleet-broker-dir",
        type=Path,
        default=None,
        help="where kit/broker/ will be on the broker host (mosquitto.conf names its files by absolute path)",
    )
    p.add_argument(
        "--fleet-device-root",
        type=Path,
        default=Path("/opt/fedge"),
        metavar="DIR",
        help="where the kit's systemd client unit expects fedge (DIR/venv) and each device's files (DIR/<run>/<id>/)",
    )
    p.add_argument(
        "--service-user",
        default="fedge",
        type=_service_user,
        metavar="NAME",
        help="the system user the kit's coordinator and client units run as (made by the printed install lines if "
        "missing; never root)",
    )
    p.add_argument("--no-tls", action="store_true", help="passwords and ACL without TLS (a loopback laptop run only)")
    p.add_argument(
        "--fleet-max-packet-size",
        type=packet_size,
        default=None,
        metavar="BYTES",
        help="the broker's max_packet_size (e.g. 1MB); the coordinator and clients learn it from the broker and send "
        "larger messages as chunks (default: sized to the run's largest message, nothing chunked)",
    )
    add_config_flags(p)
    add_plugin_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """``fedge provision``: its exit status."""
    from fedge_io.experiment import prepare
    from sim.provision import provision

    if args.fleet_broker:
        # Imported before anything is written: an installation without the kit's packages (the coordinator extra) is
        # refused in one line naming the extra (MISSING_EXTRA), instead of a traceback halfway through the kit.
        from coordinator.broker_setup import broker_plan, hand_over
        from coordinator.kit.services import device_plugins, plugin_flags
        from coordinator.run import provision_fleet

    plugins = resolved_plugins(args.plugin)
    config = config_from_args(args, deployment=True)
    if config.dp_noise_seed is not None:  # the coordinator would refuse it: refused before anything is written
        from coordinator.run import refuse_noise_seed

        refuse_noise_seed(config)
    exp = prepare(config)  # its config.json is what the coordinator will run
    files = provision(exp, args.out, plugins=plugins)
    print(f"wrote {len(files)} client data files and config.json to {args.out}")
    if args.fleet_broker:
        kit_dir = args.out.absolute() / "kit"
        plan = broker_plan(kit_dir / "broker", run=args.run, conf_dir=args.fleet_broker_dir)
        kit = provision_fleet(
            exp,
            kit_dir,
            run=args.run,
            broker_hosts=args.fleet_broker,
            port=args.fleet_port or (8883 if not args.no_tls else 1883),
            tls=not args.no_tls,
            client_certificates=args.client_certificates,
            signed_programs=args.signed_programs,
            broker_config_dir=plan.conf_dir,
            max_packet_size=args.fleet_max_packet_size,
            bind_address=args.fleet_bind,
        )
        hand_over(kit.root, kit.broker_dir)
        print(f"wrote the fleet kit to {kit.root} ({kit.root / 'README.txt'} says what goes where).")
        if plan.note:
            print(f"note: {plan.note}")
        print("start the broker on this machine with:")
        for command in plan.commands:
            print(f"    {command}")
        out = args.out.absolute()
        coordinator = ["fedge", "coordinator", "--bundle", str(kit.coordinator_dir)]
        coordinator += ["--config", str(out / "config.json"), "--run-dir", str(out / "runs" / args.run)]
        coordinator += plugin_flags(plugins)
        print("then the coordinator (the same command continues the run after a stop):")
        print(f"    {shlex.join(coordinator)}")
        # A plugin file goes to each device beside its data file; the device's command names it there.
        copied = "".join(f", {Path(p).name}" for p in plugins if device_plugins([p]) != [p])
        shared = " (and shared.safetensors, if written)"
        print(f"each client, on its device, with clients/<id>/, <id>.safetensors{copied}{shared}:")
        flags = "".join(f" {shlex.quote(w)}" for w in plugin_flags(device_plugins(plugins)))
        print(f"    fedge client --bundle clients/<id> --data <id>.safetensors --device auto{flags}")
        print("and watch the run (read-only login):")
        print(f"    {shlex.join(['fedge', 'status', '--bundle', str(kit.root / 'monitor')])}")
        print(f"keep {kit.root / 'ca'} offline: it only serves to issue new certificates")
        _write_services(args, kit.root, kit.coordinator_dir, plan.conf_dir, plugins, exp.config.secure_aggregation)
    return 0


def _write_services(
    args: argparse.Namespace,
    kit_root: Path,
    coordinator_bundle: Path,
    broker_conf_dir: Path,
    plugins: Sequence[str],
    secure_aggregation: bool,
) -> None:
    """The kit's systemd units (coordinator.kit.services), with this machine's fedge and mosquitto."""
    from coordinator.broker_setup import mosquitto_command
    from coordinator.kit.services import install_commands, write_units

    script = Path(sys.executable).with_name("fedge")
    fedge = [str(script)] if script.is_file() else [sys.executable, "-m", "fedge_cli.main"]
    out = args.out.absolute()
    write_units(
        kit_root / "systemd",
        args.run,
        mosquitto=Path(mosquitto_command()),
        broker_conf_dir=broker_conf_dir,
        fedge=fedge,
        coordinator_bundle=coordinator_bundle,
        config=out / "config.json",
        run_dir=out / "runs" / args.run,
        device_root=args.fleet_device_root,
        plugins=plugins,
        secure_aggregation=secure_aggregation,
        user=args.service_user,
    )
    print(f"or run them all as services: {kit_root / 'systemd'}")
    steps = install_commands(
        args.run,
        args.fleet_device_root,
        plugins,
        coordinator_bundle=coordinator_bundle,
        runs=out / "runs",
        user=args.service_user,
    )
    for line in steps[1:]:
        print(f"  {line}")

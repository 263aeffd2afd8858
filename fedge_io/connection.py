"""How a role reaches its broker, from its command line: a fleet bundle, or a URL plus credentials and TLS files.

Secrets never come from the command line: a password comes from a file (``--password-file``), the environment
(``$FEDGE_MQTT_PASSWORD``) or a fleet bundle (:func:`fedge_io.credentials.load_bundle`).
"""

from __future__ import annotations

import argparse
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from fedge.errors import ConfigError
from fedge.wire.protocol import BrokerAddress
from fedge_io.credentials import Bundle, load_bundle, with_credentials
from fedge_io.mqtt import PacketLimit, parse_packet_limit


def add_connection_arguments(
    p: argparse.ArgumentParser, *, broker_required: bool = False, publishes: bool = True
) -> None:
    """``--broker``, ``--bundle`` and the credential and TLS flags of a role; ``--max-packet-size`` for a role that
    ``publishes``."""
    p.add_argument(
        "--broker",
        required=broker_required,
        default=None,
        help="mqtt://HOST:PORT, or mqtts://HOST[:PORT] for TLS (with --bundle: overrides the bundle's address)",
    )
    p.add_argument(
        "--bundle",
        type=Path,
        default=None,
        help="this device's directory of a fleet kit (fedge provision --fleet-broker): run, id, password, CA",
    )
    p.add_argument("--username", default=None, help="broker user name (or $FEDGE_MQTT_USERNAME)")
    p.add_argument(
        "--password-file",
        type=Path,
        default=None,
        help="file whose first line is the password (or $FEDGE_MQTT_PASSWORD)",
    )
    p.add_argument(
        "--allow-plaintext",
        action="store_true",
        help="let a login travel over plain mqtt:// to a broker that is not on this machine, or a bundle made for TLS "
        "connect without it (only on a network you trust: anyone on the path reads the password)",
    )
    p.add_argument("--ca-file", type=Path, default=None, help="mqtts: CA certificate to verify the broker with")
    p.add_argument("--cert-file", type=Path, default=None, help="mqtts: client certificate (mutual TLS)")
    p.add_argument("--key-file", type=Path, default=None, help="mqtts: the client certificate's key")
    if not publishes:
        return
    p.add_argument(
        "--max-packet-size",
        type=packet_limit_arg,
        default="auto",
        metavar="auto|off|BYTES",
        help="the largest MQTT packet to publish; larger messages travel as chunks. auto: the limit the broker "
        "announces (MQTT 5 CONNACK), else none; BYTES (e.g. 1MB): at most that; off: never chunk",
    )


def packet_limit_arg(text: str) -> PacketLimit:
    """``--max-packet-size``'s argparse type: :func:`fedge_io.mqtt.parse_packet_limit`, its error as argparse's."""
    try:
        return parse_packet_limit(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


@dataclass(frozen=True)
class Connection:
    """Where to connect and as whom; ``bundle`` when a fleet kit's bundle said so."""

    address: BrokerAddress
    bundle: Bundle | None = None
    max_packet_size: PacketLimit = "auto"


def connection_from_args(args: argparse.Namespace) -> Connection:
    """The broker address (with login and TLS settings) the flags describe; ConfigError when they do not."""
    if args.bundle is not None:
        if args.username or args.password_file or args.ca_file or args.cert_file or args.key_file:
            raise ConfigError("--bundle carries the login and TLS files; drop --username/--password-file/--*-file")
        bundle = load_bundle(args.bundle, broker=args.broker)
        if bundle.made_for_tls and not bundle.address.tls and not args.allow_plaintext:
            raise ConfigError(
                f"fleet bundle {args.bundle} holds a CA for TLS, but --broker {args.broker} is plain mqtt://: its "
                "password would cross the network in clear. Use mqtts://HOST:PORT (the bundle's own address without "
                "--broker), or add --allow-plaintext on a network you trust"
            )
        _refuse_plaintext_login(bundle.address, args.allow_plaintext)
        return Connection(bundle.address, bundle, getattr(args, "max_packet_size", "auto"))
    if args.broker is None:
        raise ConfigError("say where the broker is: --broker mqtt://HOST:PORT, or --bundle DIR from a fleet kit")
    address = with_credentials(
        BrokerAddress.parse(args.broker), username=args.username, password_file=args.password_file
    )
    tls_files = (args.ca_file, args.cert_file, args.key_file)
    if any(f is not None for f in tls_files):
        if not address.tls:
            raise ConfigError("--ca-file/--cert-file/--key-file are for TLS: use an mqtts:// broker URL")
        ca, cert, key = (str(f) if f is not None else None for f in tls_files)
        address = address.with_tls(ca_file=ca, cert_file=cert, key_file=key)
    _refuse_plaintext_login(address, args.allow_plaintext)
    return Connection(address, max_packet_size=getattr(args, "max_packet_size", "auto"))


def _refuse_plaintext_login(address: BrokerAddress, allowed: bool) -> None:
    """A password goes over plain MQTT only to a broker on this machine, or when the user said so."""
    if address.password is None or address.tls or allowed or is_loopback(address.host):
        return
    raise ConfigError(
        f"broker {address.url} is plain mqtt:// on another machine: the password of {address.username!r} would cross "
        "the network in clear. Use mqtts://HOST:PORT with --ca-file, or add --allow-plaintext on a network you trust"
    )


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine (localhost or a loopback address)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

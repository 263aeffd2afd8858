"""TLS for a broker connection, and why a secured broker turned a connection away, in one line each.

:func:`tls_context` builds the client side of an ``mqtts://`` connection (TLS 1.2+, hostname verification, the fleet
kit's CA and, with client certificates, the device's own); the other functions turn what the TLS layer or the
broker said (an alert, a CONNACK code, a refused subscription, a connection closed early) into a
:class:`~fedge.errors.TransportError` text that names the cause and the fix. Used by :class:`fedge_io.mqtt.MqttLink`.
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence

from fedge.errors import TransportError
from fedge.wire.protocol import BrokerAddress

# OpenSSL's X509_V_ERR_* codes (x509_vfy.h) that mean "not signed by a CA we trust".
_UNTRUSTED = {2, 18, 19, 20, 21}
_CERT_NOT_YET_VALID, _CERT_EXPIRED, _HOSTNAME_MISMATCH = 9, 10, 62
# Alerts a broker sends when it rejects this side's client certificate (mutual TLS).
_CLIENT_CERT_ALERTS = (
    "CERTIFICATE_REQUIRED",
    "UNKNOWN_CA",
    "BAD_CERTIFICATE",
    "CERTIFICATE_EXPIRED",
    "UNSUPPORTED_CERTIFICATE",
)
_BUNDLE_HINT = "the files of this device's directory in the fleet kit the broker was configured from"


def tls_context(address: BrokerAddress) -> ssl.SSLContext:
    """The client side of TLS for ``address``: 1.2 or newer, its CA file (or the system's CAs), hostname verification
    unless ``address.verify_hostname`` is off, and its client certificate for mutual TLS."""
    try:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=address.ca_file)
    except OSError as exc:  # FileNotFoundError, or ssl.SSLError for a file that is not a PEM certificate
        raise TransportError(
            f"cannot use CA file {address.ca_file}: {_reason(exc)}; pass the ca.crt of {_BUNDLE_HINT}"
        ) from exc
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.check_hostname = address.verify_hostname  # CERT_REQUIRED stays on either way
    if address.cert_file:

        def refuse_passphrase() -> str:
            # Without this callback OpenSSL would prompt on the terminal for an encrypted key: a hang on a device.
            raise TransportError(
                f"client key {address.key_file or address.cert_file} is encrypted; fedge needs an unencrypted key "
                "file readable only by its user (chmod 600), like the client.key of a fleet kit"
            )

        try:
            context.load_cert_chain(address.cert_file, address.key_file, password=refuse_passphrase)
        except OSError as exc:
            raise TransportError(
                f"cannot use client certificate {address.cert_file} / key {address.key_file}: {_reason(exc)}; "
                f"pass the client.crt and client.key of {_BUNDLE_HINT}"
            ) from exc
    return context


def in_handshake(exc: OSError) -> bool:
    """Whether a connect error happened after the TCP connection was up: during the TLS handshake."""
    if isinstance(exc, (ConnectionResetError, BrokenPipeError)):
        return True
    return isinstance(exc, TimeoutError) and "handshake" in str(exc)  # ssl's "The handshake operation timed out"


def _reason(exc: OSError) -> str:
    if isinstance(exc, ssl.SSLError):
        return str(exc.reason or exc)
    return exc.strerror or str(exc)


def tls_failure(address: BrokerAddress, exc: ssl.SSLError) -> str:
    """One line: why the TLS handshake with ``address`` failed, and what to do about it."""
    where = f"TLS handshake with broker {address} failed"
    if isinstance(exc, ssl.SSLCertVerificationError):
        code = exc.verify_code
        if code == _CERT_EXPIRED:
            return (
                f"{where}: the broker's certificate has expired; issue it a new one (a new fleet kit) "
                "or, if it should still be valid, check this machine's clock"
            )
        if code == _CERT_NOT_YET_VALID:
            return f"{where}: the broker's certificate is not valid yet; check this machine's clock (`date -u`)"
        if code in _UNTRUSTED:
            trusted = f"CA file {address.ca_file}" if address.ca_file else "the system's trusted CAs"
            return (
                f"{where}: the broker's certificate is not signed by {trusted} (wrong CA); pass the ca.crt of "
                "the fleet kit that made the broker's certificate"
            )
        if code == _HOSTNAME_MISMATCH:
            return (
                f"{where}: the broker's certificate is not valid for host {address.host!r}; connect with a host "
                "name it was issued for (the fleet kit's broker hosts) or make a kit that lists this one"
            )
        return f"{where}: {exc.verify_message}; check the CA file and the broker's certificate"
    text = str(exc.reason or exc).upper()
    if "WRONG_VERSION_NUMBER" in text or "RECORD_LAYER" in text or "HTTP_REQUEST" in text:
        return f"{where}: port {address.port} does not speak TLS; use mqtt:// for a plain listener or the TLS port"
    if any(alert in text for alert in _CLIENT_CERT_ALERTS):
        return client_certificate_refusal(address, text)
    if "PROTOCOL_VERSION" in text or "UNSUPPORTED_PROTOCOL" in text:
        return f"{where}: the broker offers no TLS 1.2 or newer; configure its listener with tls_version tlsv1.2"
    if isinstance(exc, ssl.SSLEOFError) or "EOF" in text:
        return (
            f"{where}: the broker closed the connection during the handshake; is port {address.port} its TLS "
            "listener? (see the broker's log)"
        )
    return f"{where}: {exc.reason or exc}; check the CA file, the client certificate and the broker's log"


def client_certificate_refusal(address: BrokerAddress, alert: str = "") -> str:
    """One line: the broker wants a client certificate (mutual TLS) and got none, or refused the one it got."""
    alert = alert.split("] ")[-1].split(" (_ssl")[0].strip().lower()  # "[SSL: X] tlsv13 alert ... (_ssl.c:2580)"
    if address.cert_file is None:
        how = f"said: {alert}" if alert else "closed the TLS connection before answering CONNECT"
        return (
            f"broker {address} requires a client certificate (mutual TLS) and none was given (it {how}); pass the "
            "client.crt and client.key of this device's fleet bundle"
        )
    why = alert or "closed the TLS connection before answering CONNECT: expired, or from another CA?"
    return (
        f"broker {address} refused the client certificate {address.cert_file} ({why}); pass the client.crt and "
        f"client.key of {_BUNDLE_HINT}, and issue a new one if it expired"
    )


def early_close(address: BrokerAddress, last_error: str) -> str:
    """One line: the broker closed the connection before it answered CONNECT."""
    upper = last_error.upper()
    if address.tls and any(alert in upper for alert in _CLIENT_CERT_ALERTS):
        return client_certificate_refusal(address, last_error)
    if not address.tls:
        return (
            f"broker {address} closed the connection before answering CONNECT; if port {address.port} is a TLS "
            "listener, use mqtts:// (and its CA file); otherwise see the broker's log"
        )
    if "EOF" in upper:  # mosquitto may drop a TLS connection whose client certificate it refuses without an alert
        return client_certificate_refusal(address)
    detail = f" ({last_error})" if last_error else ""
    return f"broker {address} closed the connection before answering CONNECT{detail}; see the broker's log"


def login_refusal(address: BrokerAddress, client_id: str, reason: str, will_topic: str | None = None) -> str:
    """One line: why the broker's CONNACK refused this login (``reason`` as paho names the code), and the fix."""
    if reason in ("Not authorized", "Bad user name or password"):
        if address.username is None:
            return (
                f"broker {address} refused an anonymous login ({reason}): it needs a user name and password; "
                "pass this device's fleet bundle, or a user name and a password file"
            )
        causes = "wrong password or unknown user"
        if client_id != address.username:
            causes += f", or the MQTT client id {client_id!r} is not the user name (fleet brokers require it)"
        if will_topic is not None:
            causes += f", or its ACL does not allow the last will's topic {will_topic}"
        return (
            f"broker {address} refused user {address.username!r} ({reason}): {causes}; "
            "use the password file from the same fleet kit as the broker's password file"
        )
    if reason == "Client identifier not valid":
        return f"broker {address} refused MQTT client id {client_id!r}; use letters, digits, '-' and '_' only"
    return f"broker {address} refused the connection: {reason}"


def subscription_refusal(address: BrokerAddress, client_id: str, filters: Sequence[str]) -> str:
    """One line: the broker's ACL refused these subscriptions (SUBACK 0x80)."""
    who = f"user {address.username!r}" if address.username else "an anonymous client"
    return (
        f"broker {address} refused the subscription to {', '.join(filters)} of {who} (SUBACK failure: its ACL "
        "does not allow it); check that the run name and client id are those of the fleet kit the ACL came from"
    )

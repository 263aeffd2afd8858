"""Broker fixtures and fake MQTT clients for the tests of the MQTT deployment (tests/coordinator, tests/sim)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from fedge.errors import TransportError
from fedge.wire.message import decode
from fedge.wire.protocol import BrokerAddress, ClientStatus, Topics, encode_status
from fedge_io.mqtt import Inbound, MqttLink, Will
from sim.brokers import embedded_broker, find_mosquitto, mosquitto_broker


def require_mosquitto() -> None:
    """Skip the test when mosquitto is not installed (.ci/run installs it; a developer machine may not have it)."""
    try:
        find_mosquitto()
    except TransportError as exc:
        pytest.skip(str(exc))


def _mosquitto() -> Iterator[str]:
    require_mosquitto()
    with mosquitto_broker() as url:
        yield url


@pytest.fixture
def mosquitto_url() -> Iterator[str]:
    """A private mosquitto on a free loopback port, stopped after the test."""
    yield from _mosquitto()


@pytest.fixture
def embedded_url() -> Iterator[str]:
    """The embedded amqtt broker on a free loopback port."""
    with embedded_broker() as url:
        yield url


@pytest.fixture(params=["embedded", "mosquitto"])
def broker_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each test once against amqtt and once against mosquitto."""
    if request.param == "mosquitto":
        yield from _mosquitto()
    else:
        with embedded_broker() as url:
            yield url


class FakeClient:
    """A client that says hello like a real one but whose replies the test writes by hand."""

    def __init__(self, url: str, run: str, client: str, *, model: str = "", dataset_size: int = 3) -> None:
        self.topics = Topics(run)
        self.client = client
        hello = ClientStatus(client=client, state="online", runtime="fake", model=model, dataset_size=dataset_size)
        self._hello = encode_status(hello, run)
        will = encode_status(ClientStatus(client=client, state="offline", reason="connection lost"), run)
        self.link = MqttLink(
            BrokerAddress.parse(url),
            f"fake-{run}-{client}",
            subscriptions=[(self.topics.task(client), 1), (self.topics.broadcast, 1)],
            will=Will(self.topics.status(client), will),
            on_ready=self._announce,  # after every (re)connect, as a real client does
        ).start(10)

        self._held: list[Inbound] = []

    def _announce(self, link: MqttLink) -> None:
        link.publish(self.topics.status(self.client), self._hello, retain=True)

    def next(self, kind: str, timeout: float = 10.0) -> Inbound:
        """The next received message of ``kind``; others are kept for later calls (they may arrive in any order)."""
        for i, item in enumerate(self._held):
            if decode(item.payload).kind == kind:
                return self._held.pop(i)
        while True:
            got = self.link.get(timeout)
            assert got is not None, f"{self.client}: no {kind} within {timeout} s"
            if decode(got.payload).kind == kind:
                return got
            self._held.append(got)

    def close(self) -> None:
        self.link.close(wait=0.5)


@pytest.fixture
def fake_clients() -> Iterator[Callable[[str, str, str], FakeClient]]:
    """A factory of FakeClient(url, run, client, model=...); every one is disconnected after the test."""
    made: list[FakeClient] = []

    def make(url: str, run: str, client: str, **kwargs: str) -> FakeClient:
        made.append(FakeClient(url, run, client, **kwargs))
        return made[-1]

    yield make
    for fake in made:
        fake.close()

"""The coordinator's memory under a flood of large messages outside any round (issue: 10 x 50 MB held 965 MB).

Starts a private mosquitto, an :class:`coordinator.mqtt.MqttTransport` in this process, and an attacker process that
publishes ``--count`` messages of ``--mb`` MB on update topics; reports the coordinator's resident memory before and
after and its peak (``ru_maxrss``). Nothing received outside a round is kept, so the resident size returns to about
where it started; the peak is paho reading one message at a time.

    .venv/bin/python benchmarks/coordinator_flood.py [--count 10] [--mb 50]
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time

from coordinator.mqtt import MqttTransport
from fedge.wire.protocol import BrokerAddress
from sim.brokers import mosquitto_broker

ATTACKER = """
import os, sys, time
from fedge_io.mqtt import MqttLink
from fedge.wire.protocol import BrokerAddress
link = MqttLink(BrokerAddress.parse(sys.argv[1]), "attacker").start(10)
blob = os.urandom(int(float(sys.argv[3]) * 1e6))
for i in range(int(sys.argv[2])):
    link.publish(f"fedge/flood/update/c{i:03d}", blob, qos=1)
time.sleep(60)
"""


def rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=10)
    p.add_argument("--mb", type=float, default=50.0)
    args = p.parse_args()
    with mosquitto_broker() as url:
        transport = MqttTransport(BrokerAddress.parse(url), "flood").open()
        transport.available_clients()
        before, peak_before = rss_mb(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3
        attacker = subprocess.Popen([sys.executable, "-c", ATTACKER, url, str(args.count), str(args.mb)])
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and transport.outside_rounds["messages"] < args.count:
                transport.available_clients()
                time.sleep(0.1)
        finally:
            attacker.kill()
            transport.close()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3
    print(f"{transport.outside_rounds['messages']} x {args.mb:g} MB received outside rounds, none kept")
    print(f"coordinator RSS: before {before:.0f} MB, after {rss_mb():.0f} MB; peak {peak_before:.0f} -> {peak:.0f} MB")


if __name__ == "__main__":
    main()

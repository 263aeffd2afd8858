"""Client and link profiles: presets, SPEC parsing and its errors, the generators and availability traces."""

import json
import math

import pytest

from fedge.config import RunConfig
from fedge.errors import ConfigError
from fedge.profiles import (
    LINK_PRESETS,
    Availability,
    Link,
    generate_profiles,
    parse_link,
    parse_profiles,
    read_profiles,
)

CLIENTS = [f"c{i:03d}" for i in range(100)]
WIFI = LINK_PRESETS["wifi"]


@pytest.mark.parametrize(
    ("spec", "link"),
    [
        ("lte", Link(10e6, 30e6, 0.05)),
        ("wifi", Link(50e6, 100e6, 0.005)),
        ("ethernet", Link(1e9, 1e9, 0.0005)),
        ("cellular-edge", Link(1e6, 5e6, 0.12)),
        ("up=1Mbit,down=10Mbit,latency=80ms", Link(1e6, 10e6, 0.08)),
        ("up=500kbit/s, down=2e6, latency=0.2", Link(5e5, 2e6, 0.2)),
        ("lte:latency=100ms", Link(10e6, 30e6, 0.1)),
        ("ethernet:up=100Mbit", Link(100e6, 1e9, 0.0005)),
    ],
)
def test_links_parse(spec: str, link: Link):
    assert parse_link(spec) == link


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("5g", "not a preset"),
        ("up=1Mbit,down=10Mbit", "give all of"),
        ("up=1Mbyte,down=1Mbit,latency=1ms", "cannot read '1Mbyte'"),
        ("lte:jitter=5ms", "KEY=VALUE"),
        ("up=0,down=1Mbit,latency=1ms", "must be > 0"),
    ],
)
def test_a_bad_link_is_a_one_line_error(spec: str, says: str):
    with pytest.raises(ConfigError, match=says) as err:
        parse_link(spec)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("pareto:alpha=2", "not one of uniform, tail, lognormal"),
        ("tail:fraction=1.5", "fraction must be in"),
        ("tail:slowdown=ten", "slowdown must be a number"),
        ("lognormal:mu=1", "KEY=VALUE"),
        ("uniform:compute=0", "compute must be > 0"),
        ("uniform:period=60", "period=SECONDS with duty"),
        ("fleet.yaml", "not one of"),
    ],
)
def test_a_bad_profiles_spec_is_a_one_line_error(spec: str, says: str):
    with pytest.raises(ConfigError, match=says) as err:
        parse_profiles(spec)
    assert "\n" not in str(err.value)


def test_the_config_refuses_bad_specs_and_a_deadline_without_profiles():
    with pytest.raises(ConfigError, match="not a preset"):
        RunConfig(link="dialup")
    with pytest.raises(ConfigError, match="not one of"):
        RunConfig(client_profiles="slow")
    with pytest.raises(ConfigError, match="give --client-profiles or --link"):
        RunConfig(sim_deadline=30)
    assert RunConfig(link="lte", sim_deadline=30).simulated_time
    assert not RunConfig().simulated_time


def test_tail_makes_exactly_the_fraction_slow_by_the_seed():
    spec = parse_profiles("tail:fraction=0.1,slowdown=10,compute=2ms")
    assert spec.reference_s() == pytest.approx(0.002)
    profiles = generate_profiles(spec, CLIENTS, WIFI, 0.002, seed=7)
    slow = sorted(c for c, p in profiles.items() if p.compute_s == pytest.approx(0.02))
    fast = [c for c, p in profiles.items() if p.compute_s == pytest.approx(0.002)]
    assert len(slow) == 10 and len(fast) == 90
    assert slow == sorted(
        c for c, p in generate_profiles(spec, CLIENTS, WIFI, 0.002, seed=7).items() if p.compute_s > 0.01
    )
    other = generate_profiles(spec, CLIENTS, WIFI, 0.002, seed=8)
    assert slow != sorted(c for c, p in other.items() if p.compute_s > 0.01)
    assert all(p.link == WIFI for p in profiles.values())


def test_lognormal_factors_have_median_one_and_repeat_with_the_seed():
    spec = parse_profiles("lognormal:sigma=1,compute=1ms")
    many = [f"c{i:05d}" for i in range(4000)]
    profiles = generate_profiles(spec, many, WIFI, 0.001, seed=3)
    factors = sorted(p.compute_s / 0.001 for p in profiles.values())
    assert 0.9 < factors[len(factors) // 2] < 1.1
    assert factors[-1] > 10 and factors[0] < 0.1  # a spread of e^(+-3 sigma)
    assert generate_profiles(spec, many, WIFI, 0.001, seed=3) == profiles
    assert parse_profiles("uniform").reference_s() is None  # measured on this machine by the simulator
    assert parse_profiles("measure") == parse_profiles("uniform:compute=measure")


def test_periodic_availability():
    a = Availability(((0.0, 10.0),), period=60.0)
    assert a.available(0) and a.available(9.9) and not a.available(10) and not a.available(59)
    assert a.next_on(30) == 60.0 and a.next_on(65) == 65.0
    b = Availability.parse("0-1min;2min-3min")
    assert b.on == ((0.0, 60.0), (120.0, 180.0)) and b.next_on(61) == 120.0 and b.next_on(180) == math.inf
    spec = parse_profiles("uniform:compute=1ms,period=100,duty=0.25")
    profiles = generate_profiles(spec, CLIENTS, WIFI, 0.001, seed=0)
    share = sum(p.availability.available(50.0) for p in profiles.values()) / len(profiles)
    assert 0.1 < share < 0.4  # each client is on a quarter of the time, from its own phase


def test_profiles_from_csv_and_json():
    csv_text = (
        "client,compute_s,slowdown,up,down,latency,availability,period\n"
        "c000,5ms,,1Mbit,,200ms,0-30;60-90,120\n"
        "c001,,3,,,,,\n"
    )
    profiles = read_profiles(csv_text, "csv", ["c000", "c001"], WIFI, reference_s=0.001)
    assert profiles["c000"].compute_s == pytest.approx(0.005)
    assert profiles["c000"].link == Link(1e6, WIFI.down_bps, 0.2)
    assert profiles["c000"].availability == Availability(((0.0, 30.0), (60.0, 90.0)), 120.0)
    assert profiles["c001"].compute_s == pytest.approx(0.003) and profiles["c001"].link == WIFI
    rows = [{"client": "c000", "compute_s": 0.005, "up": "1Mbit", "latency": "200ms",
             "availability": "0-30;60-90", "period": 120}, {"client": "c001", "slowdown": 3}]  # fmt: skip
    assert read_profiles(json.dumps(rows), "json", ["c000", "c001"], WIFI, reference_s=0.001) == profiles
    with pytest.raises(ConfigError, match="no row for 1 client"):
        read_profiles(csv_text, "csv", ["c000", "c001", "c002"], WIFI, reference_s=0.001)
    with pytest.raises(ConfigError, match="unknown column"):
        read_profiles("client,speed\nc000,2\n", "csv", ["c000"], WIFI, reference_s=0.001)
    with pytest.raises(ConfigError, match="no reference compute"):
        read_profiles("client,slowdown\nc000,2\n", "csv", ["c000"], WIFI, reference_s=None)
    assert parse_profiles("fleet.csv:compute=2ms").path == "fleet.csv"

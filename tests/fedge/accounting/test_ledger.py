from fedge.accounting.ledger import ByteLedger, LedgerEntry, read_ledger_csv


def _ledger() -> ByteLedger:
    led = ByteLedger()
    # Round 1: one broadcast of 100 B to 3 clients, a 10 B task each, uploads of 50 B each.
    led.record(LedgerEntry(1, "down", "*", "broadcast", 3, 100, 140, 0))
    for c in ("a", "b", "c"):
        led.record(LedgerEntry(1, "down", c, "task", 1, 0, 60, 0))
        led.record(LedgerEntry(1, "up", c, "update", 1, 50, 90, 130))
    led.record(LedgerEntry(2, "up", "a", "update", 1, 7, 9, 0))
    return led


def test_multicast_counts_a_broadcast_once_and_unicast_per_recipient():
    rb = _ledger().round_bytes(1)
    assert rb.up_tensor == 150
    assert rb.down_tensor_multicast == 100
    assert rb.down_tensor_unicast == 300
    assert rb.total("tensor", "multicast") == 250
    assert rb.total("tensor", "unicast") == 450
    assert rb.total("payload", "multicast") == 270 + 140 + 180
    assert rb.total("payload", "unicast") == 270 + 420 + 180
    assert rb.total("wire") == 390


def test_rounds_are_kept_apart():
    assert _ledger().round_bytes(2).total() == 7


def test_csv_round_trip(tmp_path):
    led = _ledger()
    led.write_csv(tmp_path / "ledger.csv")
    assert read_ledger_csv(tmp_path / "ledger.csv") == list(led.entries)

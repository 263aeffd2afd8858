"""What a run costs and produced: per-round communication cost, the byte ledger and typed round records."""

"""Client-level differential privacy: the numbers of DP-FedAvg with adaptive clipping (:mod:`fedge.privacy.mechanism`),
its accountant (:mod:`fedge.privacy.accountant`), the clients' noise shares and the run's summary; the strategy that
runs it wraps an algorithm's, above the algorithms (:mod:`fedge.algorithms.differential_privacy`). See
docs/privacy.md."""

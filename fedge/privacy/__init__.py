"""Client-level differential privacy: DP-FedAvg with adaptive clipping (:mod:`fedge.privacy.strategy`), its numbers
(:mod:`fedge.privacy.mechanism`) and its accountant (:mod:`fedge.privacy.accountant`). See docs/privacy.md."""

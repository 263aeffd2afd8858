"""The simulator: in-process runs and laptop runs over a broker, communication-cost tables, reports and plots."""

"""Server-side aggregation: averaging of weights and outputs, and robust rules against poisoned updates."""

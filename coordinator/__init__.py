"""The coordinator: the round engine (sampling, deadlines, quorum, aggregation, evaluation) and its transports."""

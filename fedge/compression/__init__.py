"""Compressed tensors: the codecs (what travels instead of float32) and the strategy wrapper that applies them to a
run's messages."""

"""Local learning shared by every runtime: models, objectives and losses, the training loop, the compute backend,
evaluation metrics."""

"""Block-FP8 checkpoints: the tensors, the atomic save, the folder rules."""

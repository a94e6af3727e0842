"""The worker process: the only part of verity that imports MLX."""

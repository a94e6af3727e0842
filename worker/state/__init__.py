"""Model state: checkpoints for exact recovery, snapshots for prefix reuse, and their spill store."""

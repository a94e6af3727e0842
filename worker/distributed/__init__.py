"""The worker as an MLX distributed group: rank 0 is the worker the stack knows, the other ranks
follow it step by step (docs/design.md, "Distributed worker")."""

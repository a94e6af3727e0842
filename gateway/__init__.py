"""The gateway process: HTTP entrances, admission, SSE. Never imports MLX."""

"""Settings MLX's GPU backends read at their first operation; the worker sets them at start-up."""

from __future__ import annotations

import os
import sys

# MLX's CUDA backend caches captured graphs by topology (least recently used out when full); a
# target, a draft and the verify widths between them need more entries than the default (each
# forward would capture its graphs again: docs/design.md, "CUDA graphs"). Larger graphs also mean
# fewer launches (off macOS only: there the same variable sizes Metal's command buffers).
CUDA_GRAPH_ENV = {"MLX_CUDA_GRAPH_CACHE_SIZE": "16384",
                  # MLX raises "Cache thrashing" once a cache has missed twice its size over the
                  # process's life: a long-lived server would then fail every round meeting a new topology
                  "MLX_ENABLE_CACHE_THRASHING_CHECK": "0"}
if sys.platform != "darwin":
    CUDA_GRAPH_ENV["MLX_MAX_OPS_PER_BUFFER"] = "100"
    # cuDNN's attention builds a plan per (rows, query width, cache length): a verify of a few
    # tokens meets a new one every round; MLX's own kernels need none (docs/benchmarks.md,
    # "Shapes on a GPU").
    CUDA_GRAPH_ENV["MLX_CUDA_USE_CUDNN_SDPA"] = "0"


def apply() -> None:
    """Sets each variable unless the user set it; call before the first MLX operation."""
    for name, value in CUDA_GRAPH_ENV.items():
        os.environ.setdefault(name, value)

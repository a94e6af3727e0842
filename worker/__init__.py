"""The worker process: the only part of verity that imports MLX."""

import os
import sys

# MLX's CUDA backend replays captured CUDA graphs, cached by topology; when the cache is full it is
# cleared whole, and a target, a draft and the verify widths between them need more entries than
# the default: every forward then pays to capture its graphs again (measured on the H200: plain
# steps after drafting at 17-22 ms instead of 9; at 2048 entries the joint path's plain rounds
# still read 10-11 ms in spells, at 16384 5.4-6.6 ms before and after drafting alike). Larger
# graphs also mean fewer launches (off macOS only: there the same variable sizes Metal's command
# buffers). Read at the first GPU operation; a user's own setting wins. No effect on the CPU.
CUDA_GRAPH_ENV = {"MLX_CUDA_GRAPH_CACHE_SIZE": "16384"}
if sys.platform != "darwin":
    CUDA_GRAPH_ENV["MLX_MAX_OPS_PER_BUFFER"] = "100"
for _name, _value in CUDA_GRAPH_ENV.items():
    os.environ.setdefault(_name, _value)

"""Hand-written kernels (Metal/CUDA) and the draft forwards built on them."""

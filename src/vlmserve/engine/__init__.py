"""The only package that imports MLX.

MLX reads some settings from the environment when it first uses the GPU; serving wants
different defaults from MLX's, so they are set here, before any engine module imports
mlx. A value already in the environment (the operator's) is kept.
"""

import os

# cuDNN's fused attention builds a plan per new (batch, length) shape, and a server sees
# new shapes all the time (group sizes, prompt buckets, image counts): on the H200 a burst
# of 32 W1 requests reached its first tokens in 1.0 s with it and 0.78 s without
# (docs/benchmarks.md). MLX's own attention kernels need no per-shape plan.
os.environ.setdefault("MLX_CUDA_USE_CUDNN_SDPA", "0")

"""Whether MLX's CUDA backend records the engine's work into CUDA graphs.

MLX on CUDA records up to ~100 kernels at a time into a CUDA graph and keeps instantiated
graphs in a cache keyed by each graph's topology (its kernels and which buffers they share).
A forward whose shapes are new, or whose temporaries land in other buffers, misses that cache,
and instantiating its graphs costs tens of milliseconds on an H100. A server meets new prompt
lengths all the time: each prompt's last piece paid 20-50 ms this way, on the request path.
Launched directly, each kernel costs the host a few microseconds, which the device's work
hides. So a server runs without graphs unless told (`--cuda-graphs`) or the environment sets
MLX_USE_CUDA_GRAPHS itself. MLX reads the variable once, at its first GPU work: this is set
before any process of the server starts it. No MLX import here.
"""

from __future__ import annotations

import os

ENV = "MLX_USE_CUDA_GRAPHS"


def choose_cuda_graphs(enabled: bool) -> None:
    """On when asked; else off, unless the environment already chose."""
    if enabled:
        os.environ[ENV] = "1"
    else:
        os.environ.setdefault(ENV, "0")

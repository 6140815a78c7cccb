"""Keep PyTorch out of the server's processes.

Where torch is installed, transformers imports it (its image utilities do, at import), and on a
CUDA machine that was ~7 of the ~11 s a process took to load its processor, on the path to
ready. Nothing the server runs needs it: mlx-vlm's processors and transformers' own have NumPy
paths, which are the ones the tests run (they run without torch). Marking torch as absent
before transformers loads makes transformers take those paths on every machine alike.

A model whose own processor code needs torch: set VLMSERVE_IMPORT_TORCH=1.
"""

from __future__ import annotations

import os
import sys

TORCH_PACKAGES = ("torch", "torchvision", "torchaudio")
ALLOW_ENV = "VLMSERVE_IMPORT_TORCH"


def keep_torch_out() -> bool:
    """Make `import torch` (and torchvision, torchaudio) fail in this process, and find_spec report
    them missing, unless VLMSERVE_IMPORT_TORCH=1 or torch is loaded already. Returns whether it did."""
    if os.environ.get(ALLOW_ENV) == "1" or "torch" in sys.modules:
        return False
    for name in TORCH_PACKAGES:
        sys.modules.setdefault(name, None)  # None: the import system's "not importable" marker
    return True

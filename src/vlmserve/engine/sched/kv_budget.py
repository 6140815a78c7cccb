"""The KV memory budget in blocks: what admission, growth and preemption decide against.

Plain Python, no MLX. A block holds `block_size` positions of every layer's keys and values
in the model's dtype; a row whose KV is wider (float32 in a bfloat16 model) pays `weight`
blocks per block it holds. The runner's pools (runner/block_pool.py) own the arrays and
block ids; this only counts, so the scheduler can decide without touching the device.
"""

from __future__ import annotations

import math


class KVBudget:
    def __init__(self, total_blocks: int, block_size: int, row_blocks: int = 0, bounded: bool = True):
        if block_size < 1:
            raise ValueError("block_size must be at least 1")
        self.block_size = block_size
        self.total = max(1, total_blocks)
        # Blocks every row holds besides its positions' (a recurrent or convolution state).
        self.row_blocks = row_blocks
        self.bounded = bounded  # False: `unbounded`
        self.lent = 0  # blocks out of `total` for a while (the compile rehearsal's copy of the model)
        self.used = 0
        self.preemptions = 0

    @classmethod
    def unbounded(cls, block_size: int) -> KVBudget:
        """No budget (a model whose caches it cannot count): nothing grows or is preempted."""
        return cls(1 << 40, block_size, bounded=False)

    @property
    def free(self) -> int:
        return self.total - self.used

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold `tokens` positions."""
        return max(0, math.ceil(tokens / self.block_size))

    @property
    def full(self) -> int:
        """The total once what is lent comes back: what a prompt that could never fit is measured against."""
        return self.total + self.lent

    @property
    def max_tokens(self) -> int:
        """The longest context one row can ever hold (besides its fixed state)."""
        return max(0, self.total - self.row_blocks) * self.block_size

    def take(self, blocks: int) -> bool:
        """Count `blocks` as used if they fit; False (nothing changes) if not."""
        if blocks > self.free:
            return False
        self.used += blocks
        return True

    def give(self, blocks: int) -> None:
        self.used = max(0, self.used - blocks)

    def resize(self, total_blocks: int) -> None:
        """A new total (set once the memory left after warm-up is known); blocks in use stay."""
        self.total = max(1, total_blocks)

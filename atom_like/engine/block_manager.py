"""Fixed-size KV blocks: a free list and one block table per sequence."""
from __future__ import annotations

from collections import deque

from atom_like.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def ensure_capacity(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow `seq`'s block table to hold `num_tokens` token slots. All or nothing: returns
        False, allocating nothing, when the free list is too short."""
        needed = self.blocks_for(num_tokens) - len(seq.block_table)
        if needed > len(self.free_blocks):
            return False
        for _ in range(max(0, needed)):
            seq.block_table.append(self.free_blocks.popleft())
        return True

    def free(self, seq: Sequence) -> None:
        self.free_blocks.extend(seq.block_table)
        seq.block_table = []

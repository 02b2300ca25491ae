"""Per-step attention metadata shared by every attention backend.

One step is a flat batch of `T` query tokens from `B` sequences. Sequence `b` owns query rows
`query_start_loc[b] : query_start_loc[b + 1]`; after this step's KV writes it has
`context_lens[b]` tokens in the paged cache, so its query row `j` sits at position
`context_lens[b] - q_len[b] + j` and attends to cache positions `0 ..= that position`.
The same description covers prefill, chunked prefill over a cached prefix, decode and
speculative verification (k + 1 query rows per sequence), and mixed batches of all of them.

Everything a kernel reads per step lives in device tensors, so a captured graph can be replayed
with new values. `max_query_len` / `max_context_len` are host-side upper bounds used only to
size grids and padded buffers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [B + 1] int32
    context_lens: torch.Tensor  # [B] int32, KV length after this step's writes
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32, logical block ids
    slot_mapping: torch.Tensor  # [T] int64, cache slot per query token; -1 = do not write
    max_query_len: int
    max_context_len: int

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    @property
    def query_lens(self) -> torch.Tensor:
        return self.query_start_loc[1:] - self.query_start_loc[:-1]


def slots_for_positions(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slot (block_id * block_size + offset) of `positions[b]` for each row `b` of `block_tables`.

    int64 throughout: block ids past 65,535 times a block stride overflow 32 bits.
    """
    positions = positions.long()
    block_ids = block_tables.gather(1, (positions // block_size).unsqueeze(1)).squeeze(1).long()
    return block_ids * block_size + positions % block_size

"""Batches for the attention-kernel tests: random paged layouts and the metadata that describes them."""
from __future__ import annotations

import torch

from model_ops.attention.metadata import AttentionMetadata, slots_for_positions

# name -> (query lengths, context lengths after this step's writes). Context lengths include values
# that are not multiples of any block size, and long enough ones to span several KV splits.
BATCHES = {
    "decode": ([1, 1, 1, 1, 1], [1, 15, 16, 47, 300]),
    "verify_2": ([2, 2, 2], [5, 33, 100]),
    "verify_4": ([4, 4], [4, 70]),
    "chunked_prefill": ([12, 7], [40, 7]),
    "mixed": ([1, 4, 9, 1], [40, 12, 9, 77]),
}


def make_metadata(
    q_lens: list[int],
    context_lens: list[int],
    block_size: int,
    num_blocks: int,
    generator: torch.Generator,
    first_block_id: int = 0,
) -> AttentionMetadata:
    """Metadata for sequences whose blocks are distinct random ids in [first_block_id, num_blocks).

    The first block of sequence 0 is always the last block of the pool (offset bugs show first
    at the end of an allocation). Table entries past a sequence's last block are random valid ids
    too, so a kernel that reads past the context reads real (wrong) data instead of zeros.
    """
    blocks_per_seq = [-(-c // block_size) for c in context_lens]
    width = max(blocks_per_seq)
    pool = torch.randperm(num_blocks - first_block_id - 1, generator=generator) + first_block_id
    pool = torch.cat([torch.tensor([num_blocks - 1]), pool])
    if sum(blocks_per_seq) > pool.numel():
        raise ValueError("pool too small for the requested contexts")
    table = pool[torch.randint(0, pool.numel(), (len(q_lens), width), generator=generator)]
    taken = 0
    for seq, n in enumerate(blocks_per_seq):
        table[seq, :n] = pool[taken: taken + n]
        taken += n
    query_start_loc = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    seq_of_token = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
    positions = torch.cat([torch.arange(c - q, c) for q, c in zip(q_lens, context_lens)])
    block_tables = table.to(torch.int32)
    return AttentionMetadata(
        query_start_loc=query_start_loc,
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        block_tables=block_tables,
        slot_mapping=slots_for_positions(block_tables[seq_of_token], positions, block_size),
        max_query_len=max(q_lens),
        max_context_len=max(context_lens),
    )


def metadata_args(meta: AttentionMetadata) -> tuple:
    """Positional metadata arguments of the attention kernels."""
    return (meta.query_start_loc, meta.context_lens, meta.block_tables, meta.max_query_len, meta.max_context_len)


def nan_like(t: torch.Tensor) -> torch.Tensor:
    """Poisoned output buffer: any element the kernel fails to write stays NaN."""
    return torch.full_like(t, float("nan"))

"""Draft proposal: the EAGLE3 loop (ROCm/ATOM#631, vLLM's EagleProposer; docs/eagle3_semantics.md, "The loop").

After every target step that verified or prefilled tokens:
  1. First pass over ALL rows of the target step (prefill chunks, verify rows, mixed): row t
     pairs the token at position pos[t] + 1 with the target's aux hidden state of row t, at the
     target's own position and KV slot (vLLM/EAGLE convention). The input ids are the target's
     ids shifted left by one, with each sequence's last verified row given its next token (the
     token sampled this step, or for an unfinished prompt the next prompt token). This writes
     the draft KV of every newly verified position; rows past a sequence's accepted length
     write KV that later passes overwrite before anyone reads it.
  2. k - 1 chain steps, one query per sampling sequence, carrying the draft's own hidden state:
     positions and context lengths advance by one per step (a copy, so the target's metadata is
     untouched) and each step's slot comes from the same block table.
All inputs are device tensors, so the loop can be captured as a graph.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from model_ops.attention.kv_builder import KVCacheBuilder, PagedKVCacheBuilder
from model_ops.attention.metadata import AttentionMetadata, slots_for_positions
from spec_decode.aux_layers import AuxHiddenStates
from spec_decode.eagle3 import Eagle3Draft


@dataclass
class ProposeInputs:
    input_ids: torch.Tensor  # [T] the target step's tokens
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata  # the target step's metadata
    last_rows: torch.Tensor  # [B] per scheduled sequence: row of its last verified token
    next_token_ids: torch.Tensor  # [B] the token that follows that row
    sampling: torch.Tensor  # [S] indices of the sequences that get proposals


class Proposer(ABC):
    """Proposes `num_spec_tokens` draft tokens (target vocabulary ids) per sampling sequence.

    When `capturable`, `propose` reads only the tensors of its inputs (no host value of them), so
    decode steps can replay it as a graph.
    """

    num_spec_tokens: int
    capturable: bool = False

    def kv_builders(self) -> list[KVCacheBuilder]:
        """Builders for the draft's own KV; the runner adds them to the pool."""
        return []

    def modules_to_bind(self) -> Iterable[nn.Module]:
        return ()

    @abstractmethod
    def propose(self, inputs: ProposeInputs) -> torch.Tensor:
        """[S, num_spec_tokens] proposals, on the device."""


def first_pass_input_ids(input_ids: torch.Tensor, last_rows: torch.Tensor, next_token_ids: torch.Tensor) -> torch.Tensor:
    shifted = torch.empty_like(input_ids)
    shifted[:-1] = input_ids[1:]
    shifted[-1] = input_ids[-1]  # no successor; matters only as some sequence's last row, set below
    shifted[last_rows] = next_token_ids
    return shifted


def chain_step_metadata(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int,
                        max_context_len: int) -> AttentionMetadata:
    """One query per sequence at `positions`, seeing the cache up to and including it."""
    n = positions.shape[0]
    return AttentionMetadata(
        query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=positions.device),
        context_lens=(positions + 1).to(torch.int32),
        block_tables=block_tables,
        slot_mapping=slots_for_positions(block_tables, positions, block_size),
        max_query_len=1,
        max_context_len=max_context_len,
    )


class Eagle3Proposer(Proposer):
    """Runs an EAGLE3 draft over the aux hidden states the target writes into `aux`."""

    capturable = True

    def __init__(self, draft: Eagle3Draft, aux: AuxHiddenStates, num_spec_tokens: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, attention_backend: str = "auto",
                 kv_cache_dtype: torch.dtype | None = None, kv_scales: Sequence[Sequence[float]] | None = None):
        """`kv_cache_dtype` (default `dtype`) and, for fp8, `kv_scales`: the draft KV cache's
        storage (scales under the `eagle3_kv_scale` key)."""
        self.draft, self.aux, self.num_spec_tokens, self.block_size = draft, aux, num_spec_tokens, block_size
        self.builder = PagedKVCacheBuilder(draft.attention_layers(), block_size, kv_cache_dtype or dtype, device,
                                           role="draft", prefix="eagle3_", backend=attention_backend,
                                           kv_scales=kv_scales)

    def kv_builders(self) -> list[KVCacheBuilder]:
        return [self.builder]

    def modules_to_bind(self) -> Iterable[nn.Module]:
        return self.draft.modules()

    def propose(self, inputs: ProposeInputs) -> torch.Tensor:
        draft = self.draft
        ids = first_pass_input_ids(inputs.input_ids, inputs.last_rows, inputs.next_token_ids)
        hidden = draft.combine_hidden_states(self.aux.get(ids.shape[0]))
        post, pre = draft(ids, inputs.positions, hidden, inputs.meta)
        if inputs.sampling.numel() == 0:  # only unfinished prompts: the pass above wrote their draft KV
            return ids.new_empty(0, self.num_spec_tokens)
        rows = inputs.last_rows[inputs.sampling]
        post, carry = post[rows], draft.carry(post, pre)[rows]
        tokens = [draft.draft_token_ids(post)]
        if self.num_spec_tokens == 1:
            return tokens[0][:, None]

        block_tables = inputs.meta.block_tables[inputs.sampling]
        bound = min(inputs.meta.max_context_len + self.num_spec_tokens, block_tables.shape[1] * self.block_size)
        positions = inputs.positions[rows].clone()
        for _ in range(self.num_spec_tokens - 1):
            positions += 1
            meta = chain_step_metadata(block_tables, positions, self.block_size, bound)
            post, pre = draft(tokens[-1], positions, carry, meta)
            carry = draft.carry(post, pre)
            tokens.append(draft.draft_token_ids(post))
        return torch.stack(tokens, dim=1)

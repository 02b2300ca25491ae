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
k is chosen per step (0..num_spec_tokens, spec_decode/adaptive.py). The two parts are separate
(`first_pass`, `chain`) so that decode graphs capture one first pass per verify width and one
chain per k, not one loop per pair. All inputs are device tensors, so both can be captured.
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
    num_drafts: int  # k: drafts to propose per sampling sequence this step (0..num_spec_tokens)


@dataclass
class DraftState:
    """What the first pass leaves for the chain steps, per sampling sequence."""
    token_ids: torch.Tensor  # [S] the first draft token
    carry: torch.Tensor  # [S, H] the draft's hidden for the next step
    positions: torch.Tensor  # [S] the position of the last verified token
    block_tables: torch.Tensor  # [S, W]
    max_context_len: int  # the target step's bound


class Proposer(ABC):
    """Proposes `inputs.num_drafts` (at most `num_spec_tokens`) draft tokens (target vocabulary
    ids) per sampling sequence; `propose` is the device work."""

    num_spec_tokens: int  # the most drafts one step may propose

    def kv_builders(self) -> list[KVCacheBuilder]:
        """Builders for the draft's own KV; the runner adds them to the pool."""
        return []

    def modules_to_bind(self) -> Iterable[nn.Module]:
        return ()

    @abstractmethod
    def propose(self, inputs: ProposeInputs) -> torch.Tensor:
        """[S, inputs.num_drafts] proposals, on the device."""


class ChainProposer(Proposer):
    """A proposer made of a first pass over the target step's rows and a chain of one-query
    steps. Both read only the tensors of their inputs (no host value of them), so decode steps
    replay each as a graph when `capturable` (DecodeGraphs: one first pass per verify width, one
    chain per k)."""

    capturable: bool = True

    def propose(self, inputs: ProposeInputs) -> torch.Tensor:
        """With 0 drafts the first pass still runs: it writes the draft KV of the step's rows (the
        runner skips the draft altogether on pure decode steps)."""
        state = self.first_pass(inputs)
        if inputs.num_drafts == 0 or inputs.sampling.numel() == 0:
            return inputs.input_ids.new_empty(inputs.sampling.numel(), inputs.num_drafts)
        return self.chain(state, inputs.num_drafts)

    @abstractmethod
    def first_pass(self, inputs: ProposeInputs) -> DraftState:
        """Writes the draft KV of every row of the target step and drafts each sampling
        sequence's first token."""

    @abstractmethod
    def chain(self, state: DraftState, num_drafts: int) -> torch.Tensor:
        """[S, num_drafts]: the first pass's token, then num_drafts - 1 chain steps."""


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


class Eagle3Proposer(ChainProposer):
    """Runs an EAGLE3 draft over the aux hidden states the target writes into `aux`."""

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

    def first_pass(self, inputs: ProposeInputs) -> DraftState:
        draft = self.draft
        ids = first_pass_input_ids(inputs.input_ids, inputs.last_rows, inputs.next_token_ids)
        hidden = draft.combine_hidden_states(self.aux.get(ids.shape[0]))
        post, pre = draft(ids, inputs.positions, hidden, inputs.meta)
        rows = inputs.last_rows[inputs.sampling]
        return DraftState(draft.draft_token_ids(post[rows]), draft.carry(post, pre)[rows], inputs.positions[rows],
                          inputs.meta.block_tables[inputs.sampling], inputs.meta.max_context_len)

    def chain(self, state: DraftState, num_drafts: int) -> torch.Tensor:
        draft, tokens, carry = self.draft, [state.token_ids], state.carry
        bound = min(state.max_context_len + num_drafts, state.block_tables.shape[1] * self.block_size)
        positions = state.positions.clone()
        for _ in range(num_drafts - 1):
            positions += 1
            meta = chain_step_metadata(state.block_tables, positions, self.block_size, bound)
            post, pre = draft(tokens[-1], positions, carry, meta)
            carry = draft.carry(post, pre)
            tokens.append(draft.draft_token_ids(post))
        return torch.stack(tokens, dim=1)

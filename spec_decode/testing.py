"""Drafters for tests and benchmarks (never used in serving).

OracleProposer:

It proposes the target's own greedy continuation, known in advance, corrupting the tokens at
the positions `corrupt(request_id, num_generated, position)` chooses. Under greedy verification
the accepted count of a step is then exactly the index of its first corrupted position, which
lets tests drive every acceptance length 0..k (mixed within one batch), exactly in fp32.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from model_ops.attention.kv_builder import KVCacheBuilder
from spec_decode.proposer import ProposeInputs, Proposer

Corruption = Callable[[str, int, int], bool]


def accept_first(m: int) -> Corruption:
    """Corrupt every position from m on: each verify step accepts exactly min(m, k) drafts."""
    return lambda request_id, num_generated, position: position >= m


class OracleProposer(Proposer):
    def __init__(self, continuations: dict[str, list[int]], num_spec_tokens: int, vocab_size: int,
                 corrupt: Corruption = accept_first(1 << 30)):
        self.continuations, self.num_spec_tokens = continuations, num_spec_tokens
        self.vocab_size, self.corrupt = vocab_size, corrupt

    def propose(self, inputs: ProposeInputs) -> torch.Tensor:
        return inputs.input_ids.new_zeros(inputs.sampling.numel(), self.num_spec_tokens)  # finalize decides

    def finalize(self, drafts: torch.Tensor, inputs: ProposeInputs) -> torch.Tensor:
        rows = []
        for request_id, done in zip(inputs.request_ids, inputs.num_generated.tolist()):  # a device read: tests only
            cont = self.continuations[request_id]
            row = []
            for j in range(self.num_spec_tokens):
                token = cont[done + j] if done + j < len(cont) else 0
                row.append((token + 1) % self.vocab_size if self.corrupt(request_id, done, j) else token)
            rows.append(row)
        return torch.tensor(rows, dtype=torch.long, device=drafts.device).reshape(len(rows), self.num_spec_tokens)


class ForcedAcceptance(Proposer):
    """Runs a real drafter (its cost, captured graphs included) and has verification accept
    exactly `m` of its drafts per step: the engine's speed at acceptance length m + 1, free of the
    bf16 near-tie flips that make a precomputed continuation drift on random-weight models."""

    def __init__(self, inner: Proposer, m: int):
        self.inner, self.num_spec_tokens, self.forced_acceptance = inner, inner.num_spec_tokens, m
        self.capturable = inner.capturable

    def kv_builders(self) -> list[KVCacheBuilder]:
        return self.inner.kv_builders()

    def modules_to_bind(self) -> Iterable[nn.Module]:
        return self.inner.modules_to_bind()

    def propose(self, inputs: ProposeInputs) -> torch.Tensor:
        return self.inner.propose(inputs)

    def finalize(self, drafts: torch.Tensor, inputs: ProposeInputs) -> torch.Tensor:
        return self.inner.finalize(drafts, inputs)

"""Token embedding and LM head; a tied head shares the embedding's Parameter.

Both are vocab-parallel under tensor parallelism: rank r holds vocabulary rows
[r V/N, (r+1) V/N). The embedding looks up the ids it holds (zeros for the others) and one
all-reduce assembles every row; the head computes its rows' logits and an all-gather gives each
rank the whole [T, V], so sampling sees identical logits on every rank.
"""
from __future__ import annotations

from collections.abc import Hashable

import torch
import torch.nn.functional as F
from torch import nn

from model_ops import tp
from model_ops.linear import dense
from model_ops.tp import TPSlice


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, what: str = "vocab_size"):
        super().__init__()
        self.vocab_size = vocab_size
        self.rows = tp.rank_range(vocab_size, what)
        self.weight = nn.Parameter(torch.empty(self.rows[1] - self.rows[0], hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if tp.size() == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.rows[0]
        elsewhere = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(elsewhere, 0), self.weight).masked_fill(elsewhere[:, None], 0)
        return tp.all_reduce(out)

    def tp_slice(self, param: str, shard: Hashable | None) -> TPSlice:
        return TPSlice(0, self.vocab_size, (self.rows,))


class LMHead(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, tied_to: VocabEmbedding | None = None,
                 what: str = "vocab_size"):
        super().__init__()
        self.vocab_size = vocab_size
        self.rows = tp.rank_range(vocab_size, what)
        self.weight = tied_to.weight if tied_to is not None else nn.Parameter(
            torch.empty(self.rows[1] - self.rows[0], hidden_size), requires_grad=False
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [T, vocab]: sampling and verification compare probabilities, so round
        once, late. Ranks gather in the model dtype (half the bytes); the cast is exact."""
        return tp.all_gather(dense(hidden, self.weight), dim=-1).float()

    def tp_slice(self, param: str, shard: Hashable | None) -> TPSlice:
        return TPSlice(0, self.vocab_size, (self.rows,))

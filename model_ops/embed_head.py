"""Token embedding and LM head; a tied head shares the embedding's Parameter."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, tied_to: VocabEmbedding | None = None):
        super().__init__()
        self.weight = tied_to.weight if tied_to is not None else nn.Parameter(
            torch.empty(vocab_size, hidden_size), requires_grad=False
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits: sampling and verification compare probabilities, so round once, late."""
        return F.linear(hidden, self.weight).float()

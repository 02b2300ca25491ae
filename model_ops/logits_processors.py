"""Logits processors: what a request asks for beyond temperature / top-k / top-p.

Applied to raw logits rows before sampling, by the one sampling path (speculative
verification, which without drafts is plain sampling): every verified position is processed
with its own token history (the accepted output plus the drafts before it), so the emitted
tokens follow the processed target distribution exactly, with speculation or without.

One batched pass of tensor ops on the logits' device, in vLLM's order:
  1. logit_bias: add (row, token, value) triples (OpenAI's -100..100 per token);
  2. min_tokens: -inf on a row's stop ids (EOS, stop_token_ids) while it has too few tokens;
  3. penalties on the result: repetition (HF / vLLM: positive logits of tokens seen in the
     prompt or output are divided by r, negative ones multiplied by r), frequency (minus
     f * occurrences in the output), presence (minus p if the token occurs in the output).
Rows that ask for nothing are untouched; a batch where no row asks passes `None` and pays nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenEntries:
    """Sparse (row, token[, value]) entries of a [R, V] logits matrix."""
    rows: torch.Tensor  # [N] int64
    tokens: torch.Tensor  # [N] int64
    values: torch.Tensor | None = None  # [N] float32 (bias); None where only the position matters


@dataclass
class Penalties:
    """Penalties of the rows that have any. Token histories arrive padded with `vocab_size`
    (a column that is counted and then dropped), per sequence, and per row for the drafts that
    precede that row's position, so that a sequence's history is uploaded once, not k+1 times."""
    rows: torch.Tensor  # [P] rows of the logits
    seq_of_row: torch.Tensor  # [P] index into the per-sequence histories
    prompt_ids: torch.Tensor  # [S, Lp] int64, padded
    output_ids: torch.Tensor  # [S, Lo] int64, padded: generated tokens so far
    draft_ids: torch.Tensor  # [P, k] int64, padded: the drafts before this row's position
    presence: torch.Tensor  # [P] float32
    frequency: torch.Tensor  # [P] float32
    repetition: torch.Tensor  # [P] float32

    def apply(self, logits: torch.Tensor) -> None:
        vocab = logits.shape[1]

        def counts(ids: torch.Tensor) -> torch.Tensor:
            out = torch.zeros(ids.shape[0], vocab + 1, dtype=logits.dtype, device=logits.device)
            return out.scatter_add_(1, ids, torch.ones_like(ids, dtype=logits.dtype))[:, :vocab]

        output = counts(self.output_ids)[self.seq_of_row] + counts(self.draft_ids)
        seen = (output > 0) | (counts(self.prompt_ids)[self.seq_of_row] > 0)
        x = logits[self.rows]
        r = self.repetition[:, None]
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
        x = x - self.frequency[:, None] * output - self.presence[:, None] * (output > 0).to(x.dtype)
        logits[self.rows] = x


@dataclass
class LogitsProcessors:
    bias: TokenEntries | None = None  # added to the logits
    banned: TokenEntries | None = None  # set to -inf (min_tokens holding back stop ids)
    penalties: Penalties | None = None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """The processed logits, in float32 (a new tensor; `logits` is left as it is)."""
        out = logits.float().clone()
        if self.bias is not None:
            out.index_put_((self.bias.rows, self.bias.tokens), self.bias.values, accumulate=True)
        if self.banned is not None:
            out[self.banned.rows, self.banned.tokens] = float("-inf")
        if self.penalties is not None:
            self.penalties.apply(out)
        return out

"""Speculation statistics, with vLLM's definitions (reference/eagle3_semantics.md §5).

Counted per verification: a sequence that verified `drafted` draft tokens and accepted the
first `accepted` of them. Steps that verified nothing (prefill-only steps, sequences without
drafts) are never observed, so they cannot inflate the numbers (seed 004).
  acceptance rate          = accepted tokens / drafted tokens
  mean acceptance length   = 1 + accepted tokens / drafts   (the bonus/correction token included)
  per-position acceptance  = P(at least i+1 drafts accepted), the cumulative rate at position i
"""
from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


class SpecStats:
    def __init__(self, num_spec_tokens: int, log_every_steps: int = 100):
        self.k = num_spec_tokens
        self.log_every_steps = log_every_steps
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_at_position = [0] * num_spec_tokens  # drafts whose position i was accepted
        self.accepted_histogram = [0] * (num_spec_tokens + 1)  # drafts with exactly n accepted
        self.num_steps = 0

    def observe(self, drafted: int, accepted: int) -> None:
        if not 0 <= accepted <= drafted <= self.k:
            raise ValueError(f"accepted {accepted} of {drafted} drafted tokens (k={self.k})")
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_at_position[i] += 1
        self.accepted_histogram[accepted] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [n / self.num_drafts if self.num_drafts else 0.0 for n in self.accepted_at_position]

    def summary(self) -> str:
        per_pos = ", ".join(f"{p:.3f}" for p in self.per_position_acceptance)
        dist = ", ".join(
            f"{n}: {c / self.num_drafts:.1%}" if self.num_drafts else f"{n}: -" for n, c in enumerate(self.accepted_histogram)
        )
        return (
            f"SpecDecoding: mean acceptance length {self.mean_acceptance_length:.2f}, "
            f"acceptance rate {self.acceptance_rate:.1%} ({self.num_accepted_tokens}/{self.num_draft_tokens} drafted), "
            f"per-position [{per_pos}], accepted-count distribution {{{dist}}}"
        )

    def end_step(self) -> None:
        """Called once per engine step that verified drafts; logs every `log_every_steps`."""
        self.num_steps += 1
        if self.num_steps % self.log_every_steps == 0:
            logger.info(self.summary())

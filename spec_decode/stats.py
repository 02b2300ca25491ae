"""Speculation statistics, with vLLM's definitions (docs/eagle3_semantics.md, "Metrics").

Counted per verification: a sequence that verified `drafted` draft tokens and accepted the
first `accepted` of them. Steps that verified nothing (prefill-only steps, sequences without
drafts) are never observed, so they cannot inflate the numbers (vLLM's gating, which
ROCm/ATOM#631 adopted after prefill-only steps had inflated ATOM's acceptance).
  acceptance rate          = accepted tokens / drafted tokens
  mean acceptance length   = 1 + accepted tokens / drafts   (the bonus/correction token included)
  per-position acceptance  = P(at least i+1 drafts accepted | the draft had a token at position i),
                             the cumulative rate at position i
k may change from step to step (spec_decode/adaptive.py): a draft of d tokens counts d drafted
tokens, and per position only the drafts that reached it (d > i) count in the denominator.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass
class SpecCounts:
    """Cumulative speculation counters and the metrics derived from them; the engine's SpecStats
    and the server's /metrics snapshots are both SpecCounts."""
    num_drafts: float = 0
    num_draft_tokens: float = 0
    num_accepted_tokens: float = 0
    accepted_per_position: list[float] = field(default_factory=list)  # drafts whose position i was accepted
    num_speculative_tokens: int = 0  # the most drafts a step may propose
    drafted_per_position: list[float] = field(default_factory=list)  # drafts that had a token at position i
    num_drafts_in_use: int = 0  # k of the latest step (a gauge, not a count: `minus` keeps the newer)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        # a snapshot without denominators (an older server's /metrics) had k drafts every step
        drafted = self.drafted_per_position or [self.num_drafts] * len(self.accepted_per_position)
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, drafted, strict=True)]

    def minus(self, before: "SpecCounts") -> "SpecCounts":  # a snapshot type, never SpecStats
        """The counts accumulated since `before`."""
        def diff(a: list[float], b: list[float]) -> list[float]:
            return [x - y for x, y in zip(a, b, strict=True)]

        return type(self)(self.num_drafts - before.num_drafts, self.num_draft_tokens - before.num_draft_tokens,
                          self.num_accepted_tokens - before.num_accepted_tokens,
                          diff(self.accepted_per_position, before.accepted_per_position), self.num_speculative_tokens,
                          diff(self.drafted_per_position, before.drafted_per_position), self.num_drafts_in_use)


class SpecStats(SpecCounts):
    """The engine's counters: observed once per verification, logged every `log_every_steps` steps."""

    def __init__(self, num_spec_tokens: int, log_every_steps: int = 100):
        super().__init__(accepted_per_position=[0] * num_spec_tokens, num_speculative_tokens=num_spec_tokens,
                         drafted_per_position=[0] * num_spec_tokens)
        self.log_every_steps = log_every_steps
        self.accepted_histogram = [0] * (num_spec_tokens + 1)  # drafts with exactly n accepted
        self.num_steps = 0
        # this step's verifications by drafted and by accepted count, which end_step folds into the
        # per-position counts: a loop over a step's positions, not over every (sequence, draft)
        self._step_drafted = [0] * (num_spec_tokens + 1)
        self._step_accepted = [0] * (num_spec_tokens + 1)

    def snapshot(self) -> SpecCounts:
        return SpecCounts(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                          list(self.accepted_per_position), self.num_speculative_tokens,
                          list(self.drafted_per_position))

    def observe(self, drafted: int, accepted: int) -> None:
        if not 0 <= accepted <= drafted <= self.num_speculative_tokens:
            raise ValueError(f"accepted {accepted} of {drafted} drafted tokens (k={self.num_speculative_tokens})")
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        self.accepted_histogram[accepted] += 1
        self._step_drafted[drafted] += 1
        self._step_accepted[accepted] += 1

    def summary(self) -> str:
        per_pos = ", ".join(f"{p:.3f}" for p in self.per_position_acceptance)
        dist = ", ".join(
            f"{n}: {c / self.num_drafts:.1%}" if self.num_drafts else f"{n}: -" for n, c in enumerate(self.accepted_histogram)
        )
        return (
            f"SpecDecoding: mean acceptance length {self.mean_acceptance_length:.2f}, "
            f"acceptance rate {self.acceptance_rate:.1%} ({self.num_accepted_tokens}/{self.num_draft_tokens} drafted), "
            f"per-position [{per_pos}], accepted-count distribution {{{dist}}}, "
            f"mean k {self.num_draft_tokens / self.num_drafts if self.num_drafts else 0:.2f} of {self.num_speculative_tokens}"
        )

    def end_step(self) -> None:
        """Called once per engine step that verified drafts (after its observations: the per-position
        counts take them in here); logs every `log_every_steps`."""
        drafted = accepted = 0
        for i in range(self.num_speculative_tokens - 1, -1, -1):  # position i: verifications past i
            drafted += self._step_drafted[i + 1]
            accepted += self._step_accepted[i + 1]
            self.drafted_per_position[i] += drafted
            self.accepted_per_position[i] += accepted
        self._step_drafted = [0] * (self.num_speculative_tokens + 1)
        self._step_accepted = [0] * (self.num_speculative_tokens + 1)
        self.num_steps += 1
        if self.num_steps % self.log_every_steps == 0:
            logger.info(self.summary())

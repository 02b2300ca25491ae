"""Per-request state as the scheduler and runner see it."""
from __future__ import annotations

import enum
import time

from atom_like.sampling_params import SamplingParams, TokenLogprobs


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams):
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0  # tokens whose KV is valid in the cache
        self.spec_token_ids: list[int] = []  # draft tokens awaiting verification
        self.finish_reason: str | None = None
        self.logprobs: list[TokenLogprobs] = []
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.num_preemptions = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def generated_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, computed={self.num_computed_tokens})"

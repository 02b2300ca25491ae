"""Per-request state as the scheduler and runner see it."""
from __future__ import annotations

import enum
from collections import deque

from atom_like.sampling_params import SamplingParams, TokenLogprobs


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 stop_ids: list[int] | None = None):
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        # the next step reads its token history on the host (penalties, min_tokens, prompt logprobs):
        # False for most requests, which lets a step skip looking (params do not change once added)
        self.reads_history = params.has_penalties or params.min_tokens > 0 or params.prompt_logprobs is not None
        self.stop_ids = list(stop_ids or [])  # token ids that end it (what min_tokens holds back)
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0  # tokens whose KV is valid in the cache
        self.num_cached_tokens = 0  # of those, taken from the prefix cache at the last admission
        self.block_keys: list[bytes] = []  # prefix-cache keys of its leading full blocks (block_manager.py)
        self.spec_token_ids: list[int] = []  # draft tokens awaiting verification
        self.finish_reason: str | None = None
        self.logprobs: list[TokenLogprobs] = []
        self.prompt_logprobs: list[TokenLogprobs] = []  # for prompt tokens 1.. (with params.prompt_logprobs)
        self.num_preemptions = 0
        # steps launched whose results the host has not applied yet (overlapped scheduling: at most
        # one when the next step is scheduled): each one's known new tokens and its draft count
        self.in_flight: deque[tuple[int, int]] = deque()

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

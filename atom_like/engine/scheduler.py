"""Continuous batching with chunked prefill and preemption by recompute.

Each step spends a token budget (`max_num_batched_tokens`): first on running sequences, oldest
first (a decode costs 1 + k tokens with k draft tokens to verify; an unfinished prompt costs its
next chunk), then on admitting waiting requests, whose prompts are chunked to fit. Prefill and
decode rows share one batch. When the KV pool runs out, the newest running sequence is
preempted: its blocks are freed and it goes back to the front of the queue to be recomputed
later, so no request is ever lost and the engine never crashes for lack of KV. A request starts
from the longest cached prefix of its tokens (block_manager.py) and computes only the rest.

Overlapped scheduling (LLMEngine): step N + 1 is scheduled while step N still runs, before its
results are applied. A sequence with a step in flight starts where that step ends assuming
none of its drafts is accepted (`shift_bound` says how many may be); if that step samples, its
token and drafts are still on the device, so the sequence can only continue by one decode step
(SeqStep.follows), and its KV is reserved for the longest outcome. A sequence whose step in
flight ends it for sure (max_tokens, max_model_len) is not scheduled again; one that its step
in flight may end (EOS, a stop string) is, and the extra step's tokens are dropped.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from atom_like.engine.block_manager import BlockManager
from atom_like.engine.sequence import Sequence, SequenceStatus
from atom_like.sampling_params import TokenLogprobs
from spec_decode.stats import SpecStats


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # known tokens computed this step (a prompt chunk, or the last sampled token)
    spec_token_ids: list[int]  # draft tokens verified after them
    samples: bool  # the step ends at the sequence's last known token, so it yields a new token
    start: int = 0  # position of the first token computed (tokens whose KV is, or will be, in the cache)
    shift_bound: int | None = None  # not None: follows a sampling step in flight (see the module note)


@dataclass
class ScheduledBatch:
    seqs: list[ScheduledSeq]


@dataclass
class SeqStepResult:
    new_token_ids: list[int] = field(default_factory=list)  # accepted drafts, then one sampled token
    num_accepted: int = 0  # of the verified draft tokens
    draft_token_ids: list[int] = field(default_factory=list)  # proposals for the next step
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per new token when asked for
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # prompt tokens this step scored


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_ids: set[int], num_spec_tokens: int = 0):
        self.block_manager = block_manager
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.max_model_len, self.eos_token_ids = max_model_len, eos_token_ids
        self.num_spec_tokens = num_spec_tokens  # the most drafts a step proposes (KV is reserved for them)
        self.num_drafts_in_flight = 0  # drafts the latest launched step proposes (LLMEngine sets it)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.spec_stats = SpecStats(num_spec_tokens)
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queue

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End `seq` wherever it is (running, waiting) and return its blocks."""
        if seq.finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status, seq.finish_reason, seq.spec_token_ids = SequenceStatus.FINISHED, reason, []

    # ------------------------------------------------------------------ schedule

    def capacity_needed(self, num_computed: int, num_new: int, num_spec: int, samples: bool) -> int:
        """Token slots a sequence with `num_computed` tokens must own for this step. A sampling
        step is followed by k-1 draft chain steps whose KV lands past the verified tokens: when all
        k drafts of a verify step are accepted, the chain writes up to position num_computed + 2k - 1."""
        lookahead = self.num_spec_tokens - 1 if samples and self.num_spec_tokens else 0
        return num_computed + num_new + num_spec + lookahead

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            # plain locals and no property chains below: this loop runs once per sequence per step
            start, num_tokens = seq.num_computed_tokens, len(seq.token_ids)
            for n, _ in seq.in_flight:
                start += n
            shift_bound = None
            if seq.in_flight and num_tokens == start:  # its step in flight samples: a token we have not seen
                if self._ends_in_flight(seq, num_tokens):
                    i += 1
                    continue
                shift_bound = seq.in_flight[-1][1]
                num_spec, num_new = self.num_drafts_in_flight, 1
                spec = [-1] * num_spec
                if budget < num_new + num_spec:
                    break
            else:
                remaining = num_tokens - start
                spec = seq.spec_token_ids[:] if remaining == 1 else []
                num_spec = len(spec)
                num_new = min(remaining, budget - num_spec)
                if num_new < 1:
                    break
            samples = shift_bound is not None or num_new == num_tokens - start
            need = self.capacity_needed(start + (shift_bound or 0), num_new, num_spec, samples)
            while not self.block_manager.ensure_capacity(seq, need):
                self._preempt(self.running[-1])
                preempted = True
                if seq.status is not SequenceStatus.RUNNING:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            scheduled.append(ScheduledSeq(seq, num_new, spec, samples, start, shift_bound))
            seq.in_flight.append((num_new, num_spec))
            budget -= num_new + num_spec
            i += 1

        # Admitting new work in a step that had to preempt would only thrash the pool.
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]  # holds no blocks, has computed nothing, has no step in flight
            prefix = self.block_manager.cached_prefix(seq)
            cached = len(prefix) * self.block_manager.block_size
            remaining = seq.num_tokens - cached
            num_new = min(remaining, budget)
            samples = num_new == remaining
            if not self.block_manager.allocate(seq, prefix, self.capacity_needed(cached, num_new, 0, samples)):
                break
            seq.num_computed_tokens = cached
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, num_new, [], samples, cached))
            seq.in_flight.append((num_new, 0))
            budget -= num_new
        return ScheduledBatch(scheduled)

    def _ends_in_flight(self, seq: Sequence, num_tokens: int) -> bool:
        """The sampling step in flight ends `seq` whatever it samples (it emits at least one token)."""
        return num_tokens - seq.num_prompt_tokens + 1 >= seq.params.max_tokens or num_tokens + 1 >= self.max_model_len

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        self.running.remove(seq)
        seq.status, seq.num_computed_tokens, seq.spec_token_ids = SequenceStatus.WAITING, 0, []
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ------------------------------------------------------------------ results

    def update(self, batch: ScheduledBatch, results: list[SeqStepResult],
               stop_string: Callable[[Sequence, int], bool] | None = None) -> list[Sequence]:
        """Apply one step's results; returns the sequences that received tokens or finished.
        `stop_string(seq, token)` is told of every token appended, in order, and says whether it
        completed a stop string (the engine's detokenizer): the sequence ends there, so the tokens
        a sequence keeps are decided here and nowhere else."""
        touched, verified, caching = [], False, self.block_manager.enable_prefix_caching
        for item, result in zip(batch.seqs, results, strict=True):
            seq = item.seq
            seq.in_flight.popleft()
            if item.spec_token_ids:
                verified = True  # the step verified drafts (SpecStats counts the step even if none is kept)
            if seq.status is SequenceStatus.FINISHED:
                continue  # aborted, or ended by the step before, while this one ran
            if item.spec_token_ids:
                self.spec_stats.observe(len(item.spec_token_ids), result.num_accepted)
            if seq.status is SequenceStatus.RUNNING:
                computed_before = seq.num_computed_tokens
                seq.num_computed_tokens += item.num_new_tokens + result.num_accepted
                if caching and computed_before < seq.num_prompt_tokens:  # only prompt blocks are cached
                    self.block_manager.cache_computed_blocks(seq, computed_before)
            # else preempted after this step was launched: its tokens still count (they were drawn
            # from a valid prefix, and a seeded request must not draw them again); its KV is gone
            if not item.samples:
                continue
            for n, token in enumerate(result.new_token_ids):
                seq.token_ids.append(token)
                if result.logprobs:
                    seq.logprobs.append(result.logprobs[n])
                reason = "stop" if stop_string is not None and stop_string(seq, token) else self._stop_reason(seq, token)
                if reason is not None:
                    self.finish(seq, reason)
                    break
            else:
                if seq.status is SequenceStatus.RUNNING:
                    seq.spec_token_ids = result.draft_token_ids
            touched.append(seq)
        if verified:
            self.spec_stats.end_step()
        return touched

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p, num_tokens = seq.params, len(seq.token_ids)  # called once a token: no property calls
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            return "stop"
        if num_tokens - seq.num_prompt_tokens >= p.max_tokens or num_tokens >= self.max_model_len:
            return "length"
        return None

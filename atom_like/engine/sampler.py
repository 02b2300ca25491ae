"""The engine's sampler: the one owner of sampling. From a step's sequences (StepBatch's SeqStep:
host values, the same on every tensor-parallel rank) it builds per-row sampling tensors and
logits processors, draws every token on the device (model_ops/sampling.py: plain sampling and
speculative verification are one path), owns every RNG a draw uses (the shared one seeded with
--seed, one per request that brings a seed), and computes OpenAI-style logprobs on the device,
read back only when the step's results are collected.

Seeded requests draw only from their own generator, so their tokens do not depend on what else
shares the batch, how the prompt was chunked, or (without a draft) preemption: a preempted
request keeps its generator and draws only for tokens it keeps. With a draft, a preempted
request is re-drafted from its recomputed prefix and the draws that verify those drafts may
differ from an uninterrupted run (docs/serving.md, "Seeds").
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from itertools import accumulate

import numpy as np
import torch

from atom_like.engine.step_inputs import SeqStep
from atom_like.sampling_params import SamplingParams, TokenLogprobs
from model_ops.logits_processors import LogitsProcessors, Penalties, TokenEntries
from model_ops.sampling import SamplingTensors, Verified, Verifier, verify


def row_sampling_tensors(params: list[SamplingParams], generators: list[torch.Generator | None],
                         rows_per_seq: list[int], vocab_size: int, device: torch.device) -> SamplingTensors:
    """Sampling settings for logits rows: each sequence's settings (and generator) repeated over
    its rows (its draft tokens + 1 when verifying, else 1)."""
    repeat = np.array(rows_per_seq, dtype=np.int64)
    return SamplingTensors.build(
        np.repeat([p.temperature for p in params], repeat).tolist(), np.repeat([p.top_k for p in params], repeat).tolist(),
        np.repeat([p.top_p for p in params], repeat).tolist(),
        [g for g, n in zip(generators, rows_per_seq) for _ in range(n)], vocab_size, device,
    )


def row_logits_processors(seqs: list[SeqStep], vocab_size: int, device: torch.device) -> LogitsProcessors | None:
    """The processors of the logits rows of `seqs` (len(spec_token_ids) + 1 consecutive rows
    each): row j of a sequence scores the token after its first j drafts, so its history is the
    sequence's tokens plus drafts[:j], and it has generated num_generated + j tokens before it.
    None when no sequence asks for any processor."""
    if not any([s.params.logit_bias or (s.params.min_tokens and s.stop_ids) or s.params.has_penalties for s in seqs]):
        return None
    drafts = [s.spec_token_ids for s in seqs]
    starts = list(accumulate([0] + [len(d) + 1 for d in drafts]))[:-1]
    bias, banned, penalized = [], [], []
    for b, seq in enumerate(seqs):
        p = seq.params
        rows = np.arange(starts[b], starts[b] + len(drafts[b]) + 1)
        if p.logit_bias:
            bias.append((rows, np.fromiter(p.logit_bias, np.int64), np.fromiter(p.logit_bias.values(), np.float32)))
        if p.min_tokens and seq.stop_ids:
            held = rows[seq.num_generated + np.arange(len(rows)) < p.min_tokens]
            if len(held):
                banned.append((held, np.array(seq.stop_ids, np.int64), None))
        if p.has_penalties:
            penalized.append(b)
    if not (bias or banned or penalized):
        return None
    return LogitsProcessors(_entries(bias, device), _entries(banned, device),
                            _penalties(seqs, drafts, starts, penalized, vocab_size, device) if penalized else None)


def _entries(groups: list[tuple[np.ndarray, np.ndarray, np.ndarray | None]], device: torch.device) -> TokenEntries | None:
    """Every row of a group gets every (token, value) of the group."""
    if not groups:
        return None
    rows = np.concatenate([np.repeat(r, len(t)) for r, t, _ in groups])
    tokens = np.concatenate([np.tile(t, len(r)) for r, t, _ in groups])
    values = None
    if groups[0][2] is not None:
        values = torch.from_numpy(np.concatenate([np.tile(v, len(r)) for r, _, v in groups])).to(device)
    return TokenEntries(torch.from_numpy(rows).to(device), torch.from_numpy(tokens).to(device), values)


def _padded(lists: list[list[int]], pad: int) -> torch.Tensor:
    out = np.full((len(lists), max(1, max(len(x) for x in lists))), pad, dtype=np.int64)
    for i, x in enumerate(lists):
        out[i, :len(x)] = x
    return torch.from_numpy(out)


def _penalties(seqs: list[SeqStep], drafts: list[list[int]], starts: list[int], penalized: list[int],
               vocab_size: int, device: torch.device) -> Penalties:
    rows, seq_of_row, draft_prefixes, params = [], [], [], []
    for i, b in enumerate(penalized):
        for j in range(len(drafts[b]) + 1):
            rows.append(starts[b] + j)
            seq_of_row.append(i)
            draft_prefixes.append(drafts[b][:j])
            params.append(seqs[b].params)
    chosen = [seqs[b] for b in penalized]
    # the prompt matters only to the repetition penalty
    prompts = [s.prompt_ids for s in chosen]  # SeqStep sends the prompt only for the repetition penalty

    def floats(name: str) -> torch.Tensor:
        return torch.tensor([getattr(p, name) for p in params], dtype=torch.float32, device=device)

    return Penalties(
        rows=torch.tensor(rows, device=device), seq_of_row=torch.tensor(seq_of_row, device=device),
        prompt_ids=_padded(prompts, vocab_size).to(device),
        output_ids=_padded([s.output_ids for s in chosen], vocab_size).to(device),
        draft_ids=_padded(draft_prefixes, vocab_size).to(device),
        presence=floats("presence_penalty"), frequency=floats("frequency_penalty"),
        repetition=floats("repetition_penalty"))


@dataclass
class DeviceLogprobs:
    """Logprobs of chosen tokens and the top-n alternatives, still on the device."""
    chosen: torch.Tensor  # [N]
    top_values: torch.Tensor  # [N, w]
    top_ids: torch.Tensor  # [N, w]
    tokens: torch.Tensor  # [N] the chosen tokens
    top_n: list[int | None]  # [N] per entry: None when its request asks for none

    def to_host(self) -> list[TokenLogprobs | None]:
        chosen, tokens = self.chosen.tolist(), self.tokens.tolist()
        top_values, top_ids = self.top_values.tolist(), self.top_ids.tolist()
        out: list[TokenLogprobs | None] = []
        for row, n in enumerate(self.top_n):
            top = dict(zip(top_ids[row][:n], top_values[row][:n])) if n else {}
            out.append(None if n is None else TokenLogprobs(tokens[row], chosen[row], top))
        return out


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top_n: list[int | None]) -> DeviceLogprobs:
    """Logprob of each chosen token and the `top_n` most likely ones, under the model's raw
    (unprocessed, untempered) distribution, as OpenAI's API reports them."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, tokens[:, None]).squeeze(1)
    top_values, top_ids = logp.topk(max((n or 0 for n in top_n), default=0), dim=-1)
    return DeviceLogprobs(chosen, top_values, top_ids, tokens, top_n)


@dataclass
class Sampled:
    """One step's draws for its sampling sequences, on the device."""
    verified: Verified
    logprobs: DeviceLogprobs | None  # over [S, K + 1] entries, row-major; None when no request asks


class Sampler:
    # row settings kept for this many (request ids, drafts each) keys: a policy that changes k from
    # step to step rebuilt and uploaded them at every change (batch 128 alternating k = 1 / 3 on an
    # H100 host: 0.6 ms more host time a step than a fixed k, 2026-11-27); one per k = 0..8
    ROW_CACHE = 9

    def __init__(self, vocab_size: int, device: torch.device, seed: int):
        self.vocab_size, self.device = vocab_size, device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.request_generators: dict[str, torch.Generator] = {}  # requests that bring a seed
        self.verifier: Verifier = verify  # which drafts a step keeps and what it emits (model_ops.sampling)
        # recent steps' row settings, by (request ids, drafts each): a decode batch that keeps its
        # sequences reuses them (read-only device tensors) instead of rebuilding and uploading
        self._rows: OrderedDict[tuple, SamplingTensors] = OrderedDict()

    def drop(self, request_ids: list[str]) -> None:
        """Forget finished requests' generators (and the cached rows: a request id may come back)."""
        for request_id in request_ids:
            self.request_generators.pop(request_id, None)
        if request_ids:
            self._rows.clear()

    def _generator(self, seq: SeqStep) -> torch.Generator | None:
        if seq.params.seed is None:
            return None
        if seq.request_id not in self.request_generators:
            self.request_generators[seq.request_id] = torch.Generator(device=self.device).manual_seed(seq.params.seed)
        return self.request_generators[seq.request_id]

    def sample(self, logits: torch.Tensor, seqs: list[SeqStep], draft_ids: torch.Tensor) -> Sampled:
        """`logits` holds len(seq.spec_token_ids) + 1 rows per sequence; `draft_ids` their drafts,
        flattened (device values: a sequence whose drafts the host has not seen yet has
        placeholders in spec_token_ids, and only their count matters here)."""
        # list comprehensions, not generators: a generator costs a Python call per sequence
        num_drafts = list(map(len, [s.spec_token_ids for s in seqs]))
        key = (tuple([s.request_id for s in seqs]), tuple(num_drafts))
        st = self._rows.get(key)
        if st is None:
            st = self._rows[key] = row_sampling_tensors([s.params for s in seqs], [self._generator(s) for s in seqs],
                                                        [n + 1 for n in num_drafts], self.vocab_size, logits.device)
            if len(self._rows) > self.ROW_CACHE:
                self._rows.popitem(last=False)
        else:
            self._rows.move_to_end(key)
        processors = row_logits_processors(seqs, logits.shape[-1], logits.device)
        verified = self.verifier(logits, num_drafts, draft_ids, st, self.generator, processors)
        logprobs = None
        if any([s.params.logprobs is not None for s in seqs]):
            width = verified.token_ids.shape[1]
            logprobs = token_logprobs(logits[verified.row_index.reshape(-1)], verified.token_ids.reshape(-1).clamp_min(0),
                                      [s.params.logprobs for s in seqs for _ in range(width)])
        return Sampled(verified, logprobs)

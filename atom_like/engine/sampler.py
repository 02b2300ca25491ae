"""From a step's sequences (StepBatch's SeqStep: host values, the same on every tensor-parallel
rank) to per-row sampling tensors and logits processors, and from logits to OpenAI-style
logprobs."""
from __future__ import annotations

from itertools import accumulate

import numpy as np
import torch

from atom_like.engine.step_inputs import SeqStep
from atom_like.sampling_params import SamplingParams, TokenLogprobs
from model_ops.logits_processors import LogitsProcessors, Penalties, TokenEntries
from model_ops.sampling import SamplingTensors


def row_sampling_tensors(params: list[SamplingParams], generators: list[torch.Generator | None],
                         rows_per_seq: list[int], vocab_size: int, device: torch.device) -> SamplingTensors:
    """Sampling settings for logits rows: each sequence's settings (and generator) repeated over
    its rows (its draft tokens + 1 when verifying, else 1)."""
    expanded = [(p, g) for p, g, n in zip(params, generators, rows_per_seq) for _ in range(n)]
    return SamplingTensors.build(
        [p.temperature for p, _ in expanded], [p.top_k for p, _ in expanded],
        [p.top_p for p, _ in expanded], [g for _, g in expanded], vocab_size, device,
    )


def row_logits_processors(seqs: list[SeqStep], vocab_size: int, device: torch.device) -> LogitsProcessors | None:
    """The processors of the logits rows of `seqs` (len(spec_token_ids) + 1 consecutive rows
    each): row j of a sequence scores the token after its first j drafts, so its history is the
    sequence's tokens plus drafts[:j], and it has generated num_generated + j tokens before it.
    None when no sequence asks for any processor."""
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


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top_n: list[int | None]) -> list[TokenLogprobs | None]:
    """Logprob of each chosen token and the `top_n` most likely ones, under the model's raw
    (untempered) distribution, as OpenAI's API reports them."""
    if all(n is None for n in top_n):
        return [None] * len(top_n)
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, tokens[:, None]).squeeze(1).tolist()
    width = max(n or 0 for n in top_n)
    top_vals, top_ids = logp.topk(width, dim=-1) if width else (None, None)
    out: list[TokenLogprobs | None] = []
    for row, n in enumerate(top_n):
        if n is None:
            out.append(None)
            continue
        top = dict(zip(top_ids[row, :n].tolist(), top_vals[row, :n].tolist())) if n else {}
        out.append(TokenLogprobs(int(tokens[row]), chosen[row], top))
    return out

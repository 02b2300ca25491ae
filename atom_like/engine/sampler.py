"""From sequences to per-row sampling tensors, and from logits to OpenAI-style logprobs."""
from __future__ import annotations

import torch

from atom_like.sampling_params import SamplingParams, TokenLogprobs
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
